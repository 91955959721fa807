"""Pictures of a run, as PNG files next to its outputs: training curves, acceptance per draft
position, planned against measured extraction rate; and a draft registry's acceptance across its versions.

matplotlib's object API on its Agg canvas (no pyplot, no global figure state, no display), so the
functions are safe in Prefect's task threads and on headless machines. The Prefect tasks
(flows/stages.py) show each file as an image artifact; `data_uri` makes the file one URL.
"""

from __future__ import annotations

import base64
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

TRAIN, VAL = "tab:blue", "tab:orange"  # matplotlib's first two default colours
ESTIMATED, MEASURED = TRAIN, VAL
DPI = 100


def save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    FigureCanvasAgg(fig).print_png(str(tmp))
    tmp.replace(path)  # a reader never sees half a picture
    return path


def data_uri(path: str | Path) -> str:
    """The PNG as a `data:` URL: Prefect's image artifacts show it in both of its UIs without a
    file server (markdown artifacts do not: the new UI blanks data: URLs in markdown)."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def training_curves(metrics: list[dict], path: str | Path, best_step: int | None = None) -> Path:
    """Loss and simulated acceptance length against step, train and validation (the records of
    the train stage's metrics.jsonl)."""
    fig = Figure(figsize=(11, 4), dpi=DPI, layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    for split, color in (("train", TRAIN), ("val", VAL)):
        rows = [m for m in metrics if m["split"] == split]
        if not rows:
            continue
        steps = [m["step"] for m in rows]
        style = {"color": color, "label": "validation (held-out)" if split == "val" else "train",
                 "marker": "o" if split == "val" or len(rows) <= 30 else None, "markersize": 4}  # 1 point: a dot
        loss_ax.plot(steps, [m["loss"] for m in rows], **style)
        acc_ax.plot(steps, [m["simulated_acceptance_length"] for m in rows], **style)
    if best_step is not None:
        best = [m for m in metrics if m["split"] == "val" and m["step"] == best_step]
        if best:
            acc_ax.plot([best_step], [best[0]["simulated_acceptance_length"]], marker="*", markersize=14,
                        color=VAL, markeredgecolor="black", linestyle="none",
                        label=f"best: {best[0]['simulated_acceptance_length']:.3f} at step {best_step}")
    loss_ax.set(title="training loss", xlabel="optimizer step", ylabel="loss")
    acc_ax.set(title="simulated acceptance length", xlabel="optimizer step", ylabel="tokens per verification step")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    return save(fig, path)


def acceptance_per_position(replayed: list[float], measured: list[float], path: str | Path, *,
                            replayed_length: float | None = None, measured_length: float | None = None) -> Path:
    """Share of drafts whose first i+1 tokens were all accepted, per draft position: greedy decoding
    replayed on held-out training samples next to vLLM's measurement (either may be empty)."""
    fig = Figure(figsize=(7, 4), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    positions = max(len(replayed), len(measured))
    width = 0.38
    shift = width / 2 if replayed and measured else 0.0  # side by side, or one series centred
    for offset, values, color, label, length in (
            (-shift, replayed, ESTIMATED, "replayed (training, held-out samples)", replayed_length),
            (shift, measured, MEASURED, "vLLM, measured", measured_length)):
        if not values:
            continue
        if length is not None:
            label += f"; acceptance length {length:.3f}"
        bars = ax.bar([i + 1 + offset for i in range(len(values))], values, width, color=color, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(range(1, positions + 1))
    ax.set(title="acceptance per draft position", xlabel="draft position",
           ylabel="share of drafts accepted up to here", ylim=(0, 1.05))
    ax.grid(axis="y", alpha=0.3)
    if ax.patches:
        ax.legend(loc="upper right")
    return save(fig, path)


def extraction_rate(planned: float | None, steady: float | None, wall: float | None, path: str | Path) -> Path:
    """Hidden-state extraction in tokens/s: the plan's estimate against the measured rates."""
    rows = [(label, value) for label, value in (
        ("planned (estimate)", planned), ("measured, steady state", steady),
        ("measured, wall (start-up and load included)", wall)) if value]
    fig = Figure(figsize=(8, 2.8), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    bars = ax.barh([label for label, _ in rows], [value for _, value in rows],
                   color=[ESTIMATED if label.startswith("planned") else MEASURED for label, _ in rows])
    ax.bar_label(bars, labels=[f"{value:,.0f}" for _, value in rows], padding=3)
    ax.invert_yaxis()
    ax.set(title="extraction rate: planned against measured", xlabel="tokens per second")
    ax.margins(x=0.15)
    ax.grid(axis="x", alpha=0.3)
    return save(fig, path)


def acceptance_across_versions(numbers: list[int], measured: list[float | None], simulated: list[float | None],
                               current: int | None, path: str | Path) -> Path:
    """A draft registry's versions: vLLM's mean acceptance length (τ) and training's simulated one for
    each (None: not measured, no point), the current version starred."""
    fig = Figure(figsize=(8, 4), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for values, color, label in ((simulated, ESTIMATED, "simulated (training, held-out samples)"),
                                 (measured, MEASURED, "τ, vLLM measured")):
        points = [(n, v) for n, v in zip(numbers, values, strict=True) if v is not None]
        if points:  # a version without the figure is a gap in the line (NaN), not a point between its neighbours
            ax.plot(numbers, [float("nan") if v is None else v for v in values], color=color, marker="o", label=label)
            for n, v in points:
                ax.annotate(f"{v:.3f}", (n, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    if current is not None:
        # the star sits on the figure the gate compares: vLLM's where there is one
        tau, sim = measured[numbers.index(current)], simulated[numbers.index(current)]
        if tau is not None or sim is not None:
            ax.plot([current], [sim if tau is None else tau], marker="*", markersize=16, linestyle="none",
                    color=ESTIMATED if tau is None else MEASURED, markeredgecolor="black",
                    label=f"current: version {current}")
    ax.set_xticks(numbers)
    ax.set(title="acceptance length across draft versions", xlabel="version", ylabel="tokens per verification step")
    ax.margins(y=0.15)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    return save(fig, path)
