"""tasks/common/plots.py without Prefect: each picture is a real PNG showing what it was given."""

from __future__ import annotations

import base64

from pictures import colour_pixels
from PIL import Image

from tasks.common.plots import ESTIMATED, MEASURED, acceptance_per_position, data_uri, extraction_rate


def test_acceptance_per_position_with_and_without_a_vllm_measurement(tmp_path):
    both = acceptance_per_position([0.6, 0.3, 0.1], [0.5, 0.2, 0.05], tmp_path / "both.png",
                                   replayed_length=2.0, measured_length=1.75)
    replayed_only = acceptance_per_position([0.6, 0.3, 0.1], [], tmp_path / "replayed.png", replayed_length=2.0)
    assert colour_pixels(both, ESTIMATED) > 2000 and colour_pixels(both, MEASURED) > 2000
    assert colour_pixels(replayed_only, ESTIMATED) > 2000 and colour_pixels(replayed_only, MEASURED) == 0
    assert not list(tmp_path.glob(".tmp-*"))  # written under a temporary name, then renamed


def test_extraction_rate_skips_an_absent_estimate_and_embeds_as_a_data_url(tmp_path):
    png = extraction_rate(None, 900.0, 640.0, tmp_path / "rate.png")
    with_plan = extraction_rate(1200.0, 900.0, 640.0, tmp_path / "rate-planned.png")
    assert colour_pixels(png, ESTIMATED) == 0 and colour_pixels(png, MEASURED) > 2000
    assert colour_pixels(with_plan, ESTIMATED) > 2000
    uri = data_uri(with_plan)
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.split(",", 1)[1]) == with_plan.read_bytes()
    assert Image.open(with_plan).size == (800, 280)
