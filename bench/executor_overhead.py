"""The Ray executor against the local one: the same config run under each, side by side, and the
wall time of every stage.

    python bench/executor_overhead.py                                  # the demo config
    python bench/executor_overhead.py --config deployments/demo.yaml --set validation.live=skip

Each run is `eagle3-pipeline run CONFIG` in a process of its own, into a fresh output folder (so
nothing is cached; each has its own Prefect home), the second with `cluster.executor=ray` (a Ray
started for the run on this machine), `cluster.accelerator=CPU` and `cluster.ranks=1`: the local
run's parallelism (one extraction worker, one training process), so the difference is what the
executor adds: starting Ray, the shared-folder probe, the rank task, Ray Train's worker group.
OMP_NUM_THREADS is the machine's core count in both (a Ray task otherwise gets one thread per CPU
it requested), and the local run runs at Ray's worker niceness, 15, as the Ray run's tasks do. Stage times are each task run's start to end, read back from the run's Prefect
database, and `before_prepare` the flow's start to the first stage's. Prints one JSON line.

On a machine shared with other work the stage totals move with its load by more than the
executor's fixed costs (on the 2-core CI machine, shared, the work inside Ray's workers ran up to
2x faster than the local run's: CPU scheduling, not the executor): compare `before_prepare`, and
each stage against the work inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAY = ["cluster.executor=ray", "cluster.accelerator=CPU", "cluster.ranks=1"]
RAY_WORKER_NICENESS = 15  # Ray's default `worker_niceness`: its tasks and actors run at nice 15


def stage_seconds(output_dir: Path) -> dict[str, float]:
    """{stage: seconds from its task run's start to its end} of the last flow run in `output_dir`
    (run in a process whose PREFECT_HOME is that run's)."""
    from prefect import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.cli import stage_runs

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
    runs = stage_runs(flow_run.id)
    stages = {name: round((run.end_time - run.start_time).total_seconds(), 1)
              for name, run in runs.items() if run.start_time and run.end_time}
    before = (runs["prepare"].start_time - flow_run.start_time).total_seconds()  # Ray's start and the probe
    return {"before_prepare": round(before, 1), **stages, "flow": round(flow_run.total_run_time.total_seconds(), 1)}


def run(config: str, overrides: list[str], out: Path, nice: int = 0) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "PYTHONPATH": str(ROOT)}
    sets = [a for o in [f"output_dir={out}", *overrides] for a in ("--set", o)]
    t0 = time.monotonic()
    subprocess.run(["nice", "-n", str(nice), sys.executable, "-m", "flows.cli", "run", config, *sets], cwd=ROOT,
                   env=env, check=True)
    wall = time.monotonic() - t0
    read = subprocess.run([sys.executable, __file__, "--stages-of", str(out)], cwd=ROOT, capture_output=True,
                          text=True, check=True, env={**env, "PREFECT_HOME": str(out / ".prefect")})
    return {"command_s": round(wall, 1), **json.loads(read.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="deployments/demo.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/executor-overhead")
    p.add_argument("--stages-of", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.stages_of:
        print(json.dumps(stage_seconds(Path(a.stages_of))))
        return
    out = Path(a.out).resolve()
    local = run(a.config, a.overrides, out / "local", nice=RAY_WORKER_NICENESS)
    on_ray = run(a.config, a.overrides + RAY, out / "ray")
    print(json.dumps({"config": a.config, "overrides": a.overrides, "local": local, "ray": on_ray,
                      "ray_minus_local_s": {k: round(on_ray[k] - local[k], 1) for k in local if k in on_ray}}))


if __name__ == "__main__":
    main()
