"""What a retraining costs against a fresh run on the same data (issue 49's measurement), side by side:

    A: a fresh run on the first 90% of the conversations (in source order), promoted as version 1
    B: the retraining loop after the other 10% arrive in the drop folder: only they are answered and
       extracted, training warm-starts from version 1 with a replay share (retrain.when: always)
    C: a fresh run on all 100%, in its own output folder

    python bench/retrain_cost.py [CONFIG.yaml] [--conversations N] [--out DIR] [--set KEY=VALUE ...]
        [--variant NAME KEY=VALUE ...] [--fresh-variant NAME KEY=VALUE ...] [--heldout M] [--record]

CONFIG (default deployments/retrain-demo.yaml) gives every setting but the data: its first source's
first N conversations are split 90/10. Each run is the real command line (`eagle3-pipeline run`), its
figures read from the run's record (runs/*.json) and regeneration report. Prints one JSON object:
verifier tokens processed (tokens the verifier generated answering, and tokens it extracted) by B over
C, training steps and wall time of B over C, and each run's acceptance (simulated; vLLM's where
validation served the draft). `--record` stores the ratios (bench/record.py).

Comparing warm starts side by side: each `--variant` is B's training again, warm-started from version 1
(A's draft) with the variant's settings over B's, and not promoted; each `--fresh-variant` is C again
with its settings (another `train.seed`: how far chance alone moves C). Their prepared data and hidden
states are B's and C's (cached), so a variant costs its training. Each run's simulated acceptance is
measured by its training on its own validation samples (about 10% of the data, and the best of its
evaluations); `--heldout M` also measures every draft on the same M conversations that follow the N in
the source, answered and extracted by a run of their own: one larger set, the same for every draft.
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
from tasks.registry.layout import DRAFT, versions_dir  # noqa: E402


def run(config: dict, out: Path, name: str, overrides: list[str]) -> dict:
    """One `eagle3-pipeline run`; its record's results, the regeneration's generated tokens, the wall time."""
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(path),
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


def variant_settings(variant: list[str]) -> tuple[str, list[str]]:
    """(name, its KEY=VALUE settings) of a `--variant NAME KEY=VALUE ...`."""
    name, settings = variant[0], variant[1:]
    bad = [v for v in settings if "=" not in v]
    if not settings or bad:
        raise SystemExit(f"--variant {name}: give KEY=VALUE settings after its name ({' '.join(bad) or 'none given'})")
    return name, settings


def heldout_acceptance(draft: str, heldout_run: dict, config: dict,
                       samples: list[int] | None = None) -> dict[str, float]:
    """A draft's chained (simulated) and replayed acceptance length on the held-out run's samples (every one, or
    the manifest's rows `samples`)."""
    from tasks.common.config import TrainSettings
    from tasks.train.acceptance import simulated_acceptance_length
    from tasks.train.evaluation import evaluate_draft

    res, train = heldout_run["results"], TrainSettings(**config["train"])
    metrics = evaluate_draft(draft, res["extracted"]["manifest"], res["prepared"]["path"], train.ttt_steps,
                             train.total_seq_len, resolve(config["verifier"]["path"]), samples)
    return {"simulated": round(simulated_acceptance_length(metrics, train.ttt_steps), 4),
            "replayed": round(metrics["replayed_acceptance_length"], 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "deployments" / "retrain-demo.yaml"))
    p.add_argument("--conversations", type=int, default=160)
    p.add_argument("--out", default=None, help="where the three runs write (default: a new temporary folder)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                   help="B again, warm-started from version 1 with these settings, not promoted (repeatable)")
    p.add_argument("--fresh-variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                   help="C again with these settings (repeatable)")
    p.add_argument("--heldout", type=int, default=0, metavar="M",
                   help="measure every draft on the M conversations after the N, extracted by a run of their own")
    p.add_argument("--record", action="store_true")
    a = p.parse_args()
    variants = [variant_settings(v) for v in a.variant]
    fresh_variants = [variant_settings(v) for v in a.fresh_variant]
    out = Path(a.out or tempfile.mkdtemp(prefix="retrain-cost-"))
    base = yaml.safe_load(Path(a.config).read_text())
    read = [r.data for r in read_rows([resolve(base["data"]["sources"][0])], a.conversations + a.heldout)]
    rows, heldout_rows = ([r for r in part if not isinstance(r, Dropped)]
                          for part in (read[:a.conversations], read[a.conversations:]))
    cut = round(0.9 * len(rows))
    incoming = out / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    (out / "first-90.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:cut]))
    data = {**base["data"], "sources": [str(out / "first-90.jsonl"), str(incoming)], "max_rows": None}
    loop = {**base, "data": data, "output_dir": str(out / "loop"), "retrain": {"when": "always"},
            "registry": {"promote": True}, "train": {**base["train"], "init_from": "previous"}}
    fresh = {**loop, "output_dir": str(out / "fresh"), "train": {**base["train"], "init_from": None}}

    heldout = None
    if heldout_rows:
        (out / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout_rows))
        # a run for its prepared data and hidden states: one training step (after --set, which may lift the
        # step cap for the other runs), nothing registered
        heldout = {**fresh, "output_dir": str(out / "heldout"), "registry": {"promote": False},
                   "data": {**data, "sources": [str(out / "heldout.jsonl")]}}
        h_run = run(heldout, out, "heldout", a.overrides + ["train.max_steps=1"])
    measured = {}

    def measure(name: str, config: dict, settings: list[str]) -> None:
        """One run, its figures (and its draft's on the held-out samples), printed as soon as they are known."""
        r = run(config, out, name, a.overrides + settings)
        measured[name] = figures(r)
        if heldout:
            measured[name]["heldout"] = heldout_acceptance(r["results"]["trained"]["draft_path"], h_run, heldout)
        print(f"{name}: {json.dumps(measured[name])}", file=sys.stderr, flush=True)

    # A's data is the first 90% alone: a run again with --out (more variants) finds A, B and C done (cached)
    (incoming / "last-10.jsonl").unlink(missing_ok=True)
    measure("A", loop, [])
    (incoming / "last-10.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[cut:]))
    measure("B", loop, [])
    measure("C", fresh, [])
    # B's variants start from version 1, A's draft, whatever B made current since
    version_1 = versions_dir(Path(loop["output_dir"]) / "registry" / loop["name"]) / "1" / DRAFT
    warm = {**loop, "registry": {"promote": False}, "train": {**loop["train"], "init_from": str(version_1)}}
    for name, settings in variants:
        measure(name, warm, settings)
    for name, settings in fresh_variants:
        measure(name, fresh, settings)
    B, C = measured["B"], measured["C"]
    report = {"conversations": len(rows), "first": cut, "new": len(rows) - cut,
              "heldout_samples": h_run["results"]["extracted"]["samples"] if heldout else 0, **measured,
              "verifier_tokens_B_over_C": round(B["verifier_tokens"] / C["verifier_tokens"], 3),
              "train_steps_B_over_C": round(B["train_steps"] / C["train_steps"], 3),
              "train_wall_B_over_C": round(B["train_wall_s"] / C["train_wall_s"], 3),
              "run_wall_B_over_C": round(B["run_wall_s"] / C["run_wall_s"], 3), "out": str(out)}
    print(json.dumps(report, indent=1))
    if a.record:
        from bench.record import record

        beside = {"conversations": len(rows), "B": B, "C": C}
        record({"retrain_verifier_tokens_over_fresh": {"value": report["verifier_tokens_B_over_C"], "goal": 0.15,
                                                       **beside},
                "retrain_train_steps_over_fresh": {"value": report["train_steps_B_over_C"], "goal": 0.3,
                                                   "train_wall_B_over_C": report["train_wall_B_over_C"],
                                                   "run_wall_B_over_C": report["run_wall_B_over_C"]}})
    if not a.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
