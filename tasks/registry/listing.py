"""The table `eagle3-pipeline drafts list` prints: one row per version, the current one marked."""

from __future__ import annotations

from pathlib import Path

from tasks.registry.layout import current, versions


def table(registry_dir: str | Path) -> str:
    rows = versions(registry_dir)
    if not rows:
        return f"no draft registered in {registry_dir}"
    now = current(registry_dir)
    header = ("version", "created (UTC)", "τ (vLLM)", "simulated", "validation", "parent", "current")
    lines = [header]
    for v in rows:
        lines.append((str(v.number), v.created[:19].replace("T", " "),
                      "-" if v.tau is None else f"{v.tau:.3f} (k={v.measured_k})",
                      "-" if v.simulated is None else f"{v.simulated:.3f}",
                      "passed" if v.validation_passed else "failed", v.parent or "-",
                      "*" if now is not None and now.number == v.number else ""))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)
