"""Reading pictures back in tests: how many pixels of a plot colour a PNG holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import to_rgb
from PIL import Image


def colour_pixels(png: str | Path, colour: str, tolerance: int = 12) -> int:
    """Pixels within `tolerance` (per channel, 0-255) of a matplotlib colour, e.g. "tab:blue"."""
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    target = np.array([round(255 * c) for c in to_rgb(colour)])
    return int((np.abs(pixels - target).max(axis=-1) <= tolerance).sum())
