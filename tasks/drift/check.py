"""The drift check's measurement: a draft's simulated acceptance length on sets of extracted samples,
each measured the same way in one process on one device, so that the figures compare.

It runs as a worker process (`python -m tasks.drift.check`, tasks/common/workers.py) unless asked to
run in the caller: the draft and the verifier's head are loaded there and freed with the process.
The figure is the chained simulated acceptance length (tasks/train/acceptance.py), the one training
selects its best checkpoint by and records, so that a figure recorded then compares with one measured now.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.common.progress import ProgressCallback, ProgressEvent
from tasks.common.workers import rank_worker_main

log = logging.getLogger(__name__)

RESULT_NAME = "acceptance.json"


@dataclass(frozen=True)
class AcceptanceJob:
    """What the measuring process needs, JSON-serializable. `sample_sets`: a name -> {"manifest",
    "prepared", "samples"} (the manifest's sample positions) for each set to measure."""

    draft: str
    verifier_path: str
    out_dir: str
    sample_sets: dict[str, dict]
    ttt_steps: int
    total_seq_len: int


def device_name() -> str:
    import torch

    return f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"


def measure_acceptance(job: AcceptanceJob, rank: int = 0, world_size: int = 1,
                       callback: ProgressCallback | None = None) -> dict:
    """Each set's simulated acceptance length, and the device that measured them; written to
    `<out_dir>/acceptance.json` and returned. `rank`/`world_size`: a worker's (one process measures)."""
    from tasks.train.acceptance import simulated_acceptance_length
    from tasks.train.evaluation import draft_evaluator

    t0 = time.monotonic()
    acceptance = {}
    score = draft_evaluator(job.draft, job.ttt_steps, job.total_seq_len, job.verifier_path)
    for done, (name, sample_set) in enumerate(job.sample_sets.items()):
        if callback:
            callback(ProgressEvent("drift check", done, len(job.sample_sets), "sample sets", None, None,
                                   time.monotonic() - t0, f"measuring the {name} samples"))
        metrics = score(sample_set["manifest"], sample_set["prepared"], sample_set["samples"])
        acceptance[name] = simulated_acceptance_length(metrics, job.ttt_steps)
        log.info("simulated acceptance length on the %d %s samples: %.4f", len(sample_set["samples"]), name,
                 acceptance[name])
    result = {"acceptance": acceptance, "device": device_name()}
    path = Path(job.out_dir) / RESULT_NAME
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)  # a result file is whole or absent
    return result


def main(argv: list[str] | None = None) -> int:
    """One measuring process: `python -m tasks.drift.check --job JOB.json`."""
    return rank_worker_main("tasks.drift.check", AcceptanceJob, measure_acceptance, argv)


if __name__ == "__main__":
    raise SystemExit(main())
