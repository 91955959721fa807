"""What a retraining costs against a fresh run on the same data (issue 49's measurement), side by side:

    A: a fresh run on the first 90% of the conversations (in source order), promoted as version 1
    B: the retraining loop after the other 10% arrive in the drop folder: only they are answered and
       extracted, training warm-starts from version 1 with a replay share (retrain.when: always)
    C: a fresh run on all 100%, in its own output folder

    python bench/retrain_cost.py [CONFIG.yaml] [--conversations N] [--out DIR] [--set KEY=VALUE ...] [--record]

CONFIG (default deployments/retrain-demo.yaml) gives every setting but the data: its first source's
first N conversations are split 90/10. Each run is the real command line (`eagle3-pipeline run`), its
figures read from the run's record (runs/*.json) and regeneration report. Prints one JSON object:
verifier tokens processed (tokens the verifier generated answering, and tokens it extracted) by B over
C, training steps and wall time of B over C, and each run's acceptance (simulated; vLLM's where
validation served the draft). `--record` stores the ratios (bench/record.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.common.demo_assets import resolve  # noqa: E402
from tasks.prepare.chat_data import Dropped, read_rows  # noqa: E402


def run(config: dict, out: Path, name: str, overrides: list[str]) -> dict:
    """One `eagle3-pipeline run`; its record's results, the regeneration's generated tokens, the wall time."""
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    t0 = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "eagle3-pipeline"), "run", str(path),
                           *[a for o in overrides for a in ("--set", o)]], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"run {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = sorted((Path(config["output_dir"]) / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    results = json.loads(records[-1].read_text())["results"]
    made_from = results["prepared"]["made_from"]
    generated = json.loads((Path(made_from[0]) / "report.json").read_text())["generated_tokens"] if made_from else 0
    return {"results": results, "generated_tokens": generated, "wall_s": round(wall, 1)}


def figures(r: dict) -> dict:
    res = r["results"]
    return {"conversations_answered": res["prepared"]["conversations_answered"],
            "generated_tokens": r["generated_tokens"], "tokens_extracted": res["extracted"]["tokens_extracted"],
            "tokens_reused": res["extracted"]["tokens_reused"],
            "verifier_tokens": r["generated_tokens"] + res["extracted"]["tokens_extracted"],
            "train_steps": res["trained"]["steps"], "train_wall_s": res["trained"]["wall_s"],
            "run_wall_s": r["wall_s"], "new_samples": res["trained"]["new_samples"],
            "replayed_samples": res["trained"]["replayed_samples"],
            "simulated_acceptance_length": res["trained"]["simulated_acceptance_length"],
            "vllm_acceptance_length": res["validated"]["mean_acceptance_length"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "deployments" / "retrain-demo.yaml"))
    p.add_argument("--conversations", type=int, default=160)
    p.add_argument("--out", default=None, help="where the three runs write (default: a new temporary folder)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--record", action="store_true")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="retrain-cost-"))
    base = yaml.safe_load(Path(a.config).read_text())
    rows = [r.data for r in read_rows([resolve(base["data"]["sources"][0])], a.conversations)
            if not isinstance(r.data, Dropped)]
    cut = round(0.9 * len(rows))
    incoming = out / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    (out / "first-90.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:cut]))
    data = {**base["data"], "sources": [str(out / "first-90.jsonl"), str(incoming)], "max_rows": None}
    loop = {**base, "data": data, "output_dir": str(out / "loop"), "retrain": {"when": "always"},
            "registry": {"promote": True}, "train": {**base["train"], "init_from": "previous"}}
    fresh = {**loop, "output_dir": str(out / "fresh"), "train": {**base["train"], "init_from": None}}

    a_run = run(loop, out, "A", a.overrides)
    (incoming / "last-10.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[cut:]))
    b_run = run(loop, out, "B", a.overrides)
    c_run = run(fresh, out, "C", a.overrides)
    A, B, C = figures(a_run), figures(b_run), figures(c_run)
    report = {"conversations": len(rows), "first": cut, "new": len(rows) - cut, "A": A, "B": B, "C": C,
              "verifier_tokens_B_over_C": round(B["verifier_tokens"] / C["verifier_tokens"], 3),
              "train_steps_B_over_C": round(B["train_steps"] / C["train_steps"], 3),
              "train_wall_B_over_C": round(B["train_wall_s"] / C["train_wall_s"], 3),
              "run_wall_B_over_C": round(B["run_wall_s"] / C["run_wall_s"], 3), "out": str(out)}
    print(json.dumps(report, indent=1))
    if a.record:
        from bench.record import record

        measured = {"conversations": len(rows), "B": B, "C": C}
        record({"retrain_verifier_tokens_over_fresh": {"value": report["verifier_tokens_B_over_C"], "goal": 0.15,
                                                       **measured},
                "retrain_train_steps_over_fresh": {"value": report["train_steps_B_over_C"], "goal": 0.3,
                                                   "train_wall_B_over_C": report["train_wall_B_over_C"],
                                                   "run_wall_B_over_C": report["run_wall_B_over_C"]}})
    if not a.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
