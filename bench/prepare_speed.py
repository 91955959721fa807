"""prepare's rate and peak memory: one tokenizing process against a pool, on the same rows, side by
side in one run; and the same at K times the rows (memory must not grow with the data).

    python bench/prepare_speed.py [--verifier DIR --data sharegpt.json] [--max-seq-len 1024]
                                  [--workers 1 2 ...] [--copies 1 4] [--record]

The data (default: the demo's SmolLM2 and ShareGPT) is written K times into one JSONL file per
`--copies` value. Each (copies, workers) pair runs `tasks.prepare.stage.prepare` in a fresh process
into a fresh folder, timed from the call to its return (tokenizer load, pool start and the
`datasets` write included: what a user waits for), the CPU time of the calling process alone (what
bounds a pool of many workers), its peak resident memory and its workers' taken from getrusage. Prints one JSON object; `--record` stores the figures (bench/record.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.common.demo_assets import ensure_asset  # noqa: E402
from tasks.prepare.chat_data import Dropped, read_rows  # noqa: E402


def child(verifier: str, data: str, out: str, max_seq_len: int, workers: int) -> None:
    """One timed prepare in this process; prints its figures."""
    from tasks.prepare.stage import prepare

    t0, cpu0 = time.perf_counter(), time.process_time()
    result = prepare(verifier, [data], out, max_seq_len=max_seq_len, workers=workers)
    wall, parent_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print(json.dumps({"rows": result.rows, "tokens": result.tokens, "wall_s": round(wall, 2),
                      "parent_cpu_s": round(parent_cpu, 2),  # this process alone: reading, sending, writing
                      "rows_per_s": round(result.rows / wall, 1),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                      "peak_worker_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 3)}))


def write_copies(data: str, copies: int, path: Path) -> Path:
    rows = [json.dumps(r.data) for r in read_rows([data]) if not isinstance(r.data, Dropped)]
    with path.open("w") as f:
        for _ in range(copies):
            f.write("\n".join(rows) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--copies", type=int, nargs="+", default=[1, 4])
    p.add_argument("--record", action="store_true")
    p.add_argument("--child", nargs=3, metavar=("DATA", "OUT", "WORKERS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    verifier = a.verifier or str(ensure_asset("smollm2-135m-instruct"))
    if a.child:
        return child(verifier, a.child[0], a.child[1], a.max_seq_len, int(a.child[2]))
    data = a.data or str(ensure_asset("sharegpt"))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="prepare-speed-") as work:
        for copies in a.copies:
            source = write_copies(data, copies, Path(work) / f"rows-x{copies}.jsonl")
            for workers in a.workers:
                out = Path(work) / f"out-x{copies}-w{workers}"
                done = subprocess.run([sys.executable, __file__, "--verifier", verifier, "--max-seq-len",
                                       str(a.max_seq_len), "--child", str(source), str(out), str(workers)],
                                      check=True, capture_output=True, text=True)
                runs[f"x{copies}-w{workers}"] = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"x{copies} workers {workers}: {runs[f'x{copies}-w{workers}']}", file=sys.stderr)
    one, most = min(a.workers), max(a.workers)
    result = {"runs": runs, "max_seq_len": a.max_seq_len,
              "pool_over_one": {f"x{c}": round(runs[f"x{c}-w{most}"]["rows_per_s"] / runs[f"x{c}-w{one}"]["rows_per_s"], 3)
                                for c in a.copies}}
    print(json.dumps(result))
    if a.record:
        from bench.record import record

        big = f"x{max(a.copies)}-w{most}"
        record({"prepare_rows_per_s": {"value": runs[big]["rows_per_s"], "unit": f"conversations/s, {most} processes, "
                                       f"wall from the call (tokenizer load, pool start, write included)", **result},
                "prepare_pool_over_one": {"value": result["pool_over_one"][f"x{max(a.copies)}"],
                                          "unit": f"rows/s of {most} processes over {one}, same rows"}})


if __name__ == "__main__":
    main()
