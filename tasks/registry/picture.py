"""`<registry_dir>/acceptance.png`: τ across the registry's versions, the current one marked."""

from __future__ import annotations

from pathlib import Path

from tasks.registry.layout import PICTURE, current, versions


def draw_acceptance(registry_dir: str | Path) -> Path | None:
    """The picture drawn anew from the versions on disk; None where there is no version yet."""
    from tasks.common.plots import acceptance_across_versions  # matplotlib: only where a picture is drawn

    rows = versions(registry_dir)
    if not rows:
        return None
    now = current(registry_dir)
    return acceptance_across_versions([v.number for v in rows], [v.tau for v in rows], [v.simulated for v in rows],
                                      now.number if now else None, Path(registry_dir) / PICTURE)
