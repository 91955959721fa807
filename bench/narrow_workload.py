"""The retraining loop on a narrow workload, and the drift check's figures at scale (issue 49, D):

    C: a fresh run on the first N conversations of CONFIG's first source, promoted as version 1
    S: the loop (retrain.when: drift) after the next M conversations of the same file arrive: the drift
       check should find no drift, and the run train nothing
    D: the loop after they are gone and K prompts of one kind arrive, written by the verifier under
       SYSTEM_PROMPT (mathematics by default) and answered by it: the drift check should find drift, and
       the run warm-start from version 1, gate and promote version 2
    H: a run of its own on other prompts of that kind (another synthesis seed, those also in D's left out),
       for held-out samples (one training step, nothing registered)

    python bench/narrow_workload.py [CONFIG.yaml] [--conversations N] [--same-kind M] [--prompts K]
        [--heldout-prompts P] [--system-prompt TEXT] [--out DIR] [--set KEY=VALUE ...] [--noise-draws R]

Prints and writes OUT/narrow-workload/report.json: each run's figures and drift decision, versions 1 and 2
scored on H's samples and on S's (simulated and replayed acceptance), H's prompts (to serve both versions
in vLLM elsewhere: `jq -c '.heldout_prompts[] | {prompt: .}' report.json > narrow.jsonl`, then
bench/validate_returned_draft.py DRAFT --prompts-file narrow.jsonl), and what chance alone does to the drift
check's figure: version 1 on two disjoint random sets of S's samples (the same kind), n samples each, R
draws per n; the relative difference between the two, which a drift check of that size reads as drift
where it passes the threshold.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.retrain_cost import figures, heldout_acceptance, run  # noqa: E402
from tasks.common.demo_assets import resolve  # noqa: E402
from tasks.drift import new_sample_indices  # noqa: E402
from tasks.prepare.chat_data import Dropped, read_rows  # noqa: E402
from tasks.registry.layout import current, find_version  # noqa: E402

MATHEMATICS = "You are an AI assistant that solves mathematics problems, from arithmetic to calculus, step by step."
NOISE_SIZES = (4, 8, 16, 32, 64, 128)


def drift_noise(draft: str, verifier: str, manifest: str, prepared: str, pool: list[int], config: dict,
                draws: int) -> list[dict]:
    """For each n: the relative difference of the draft's simulated acceptance between two disjoint random
    sets of n samples of `pool` (one kind of data), over `draws` draws; and the sets' answer tokens."""
    from tasks.common.config import TrainSettings
    from tasks.drift.samples import answer_tokens
    from tasks.train.acceptance import simulated_acceptance_length
    from tasks.train.evaluation import draft_evaluator

    train = TrainSettings(**config["train"])
    score = draft_evaluator(draft, train.ttt_steps, train.total_seq_len, verifier)
    rows = []
    for n in (n for n in NOISE_SIZES if 2 * n <= len(pool)):
        differences, tokens = [], []
        for draw in range(draws):
            chosen = random.Random(draw).sample(pool, 2 * n)
            a, b = (simulated_acceptance_length(score(manifest, prepared, half), train.ttt_steps)
                    for half in (chosen[:n], chosen[n:]))
            differences.append(abs(a - b) / statistics.mean([a, b]))
            tokens.append(answer_tokens(manifest, prepared, chosen[:n]))
        differences.sort()
        rows.append({"samples": n, "answer_tokens_median": int(statistics.median(tokens)), "draws": draws,
                     "relative_difference_median": round(statistics.median(differences), 4),
                     "relative_difference_max": round(differences[-1], 4)})
        print(f"noise at {n} samples: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "deployments" / "retrain-demo.yaml"))
    p.add_argument("--conversations", type=int, default=160)
    p.add_argument("--same-kind", type=int, default=40, metavar="M")
    p.add_argument("--prompts", type=int, default=64, metavar="K")
    p.add_argument("--heldout-prompts", type=int, default=32, metavar="P")
    p.add_argument("--system-prompt", default=MATHEMATICS)
    p.add_argument("--noise-draws", type=int, default=8, metavar="R")
    p.add_argument("--out", default=None, help="where the runs write (default: a new temporary folder)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="narrow-workload-"))
    base = yaml.safe_load(Path(a.config).read_text())
    read = [r.data for r in read_rows([resolve(base["data"]["sources"][0])], a.conversations + a.same_kind)]
    rows, next_rows = ([r for r in part if not isinstance(r, Dropped)]
                       for part in (read[:a.conversations], read[a.conversations:]))
    incoming = out / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    (out / "base.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # CONFIG's synthesis settings, but prompts only where a run asks for them (C and S read the file alone)
    synthesis = base["data"].get("synthesize", {})
    data = {**base["data"], "sources": [str(out / "base.jsonl"), str(incoming)], "max_rows": None,
            "synthesize": {**synthesis, "prompts": 0}}
    loop = {**base, "data": data, "output_dir": str(out / "narrow"), "registry": {"promote": True},
            "retrain": {**base.get("retrain", {}), "when": "always"}, "train": {**base["train"], "init_from": "previous"}}
    steered = {**synthesis, "system_prompts": [a.system_prompt]}
    report: dict = {"conversations": len(rows), "same_kind": len(next_rows), "system_prompt": a.system_prompt}

    # C, then S: the same kind of data arrives (the drift check decides)
    next_file = incoming / "same-kind.jsonl"
    next_file.unlink(missing_ok=True)
    c_run = run(loop, out, "C", a.overrides)
    report["C"] = figures(c_run)
    next_file.write_text("".join(json.dumps(r) + "\n" for r in next_rows))
    drift_loop = {**loop, "retrain": {**loop["retrain"], "when": "drift"}}
    s_run = run(drift_loop, out, "S", a.overrides)
    report["S"] = {"drift": s_run["results"].get("drift"), "trained": "trained" in s_run["results"],
                   "run_wall_s": s_run["wall_s"]}
    print(f"S: {json.dumps(report['S'])}", file=sys.stderr, flush=True)

    # D: that file gone, prompts of one kind arrive
    next_file.unlink()
    narrow = {**drift_loop, "data": {**data, "synthesize": {**steered, "prompts": a.prompts}}}
    d_run = run(narrow, out, "D", a.overrides)
    report["D"] = {**figures(d_run), "drift": d_run["results"].get("drift")}
    print(f"D: {json.dumps(report['D'])}", file=sys.stderr, flush=True)

    # H: held-out prompts of that kind, answered and extracted by a run of their own
    seed = 1_000_000  # prompt i is sampled with seed + i: none of D's seeds
    heldout = {**loop, "output_dir": str(out / "heldout-narrow"), "registry": {"promote": False},
               "train": {**loop["train"], "init_from": None},
               "data": {**data, "sources": [], "synthesize": {**steered, "prompts": a.heldout_prompts, "seed": seed}}}
    h_run = run(heldout, out, "H", a.overrides + ["train.max_steps=1"])
    trained_on = {json.loads(line)["messages"][0]["content"]
                  for line in next(Path(narrow["output_dir"], "synthesized").glob("*/prompts.jsonl")).read_text()
                  .splitlines()}
    heldout_prompts = [json.loads(line)["messages"][0]["content"]
                       for line in next(Path(heldout["output_dir"], "synthesized").glob("*/prompts.jsonl")).read_text()
                       .splitlines()]
    report["H"] = {"prompts": len(heldout_prompts), "also_in_D": sum(t in trained_on for t in heldout_prompts),
                   "samples": h_run["results"]["extracted"]["samples"]}
    report["heldout_prompts"] = [t for t in heldout_prompts if t not in trained_on]

    # C's draft (version 1) and D's (current) on H's samples, the narrow kind, and on S's new ones, the broad kind
    registry = Path(loop["output_dir"]) / "registry" / loop["name"]
    s_res = s_run["results"]
    same_kind = new_sample_indices(s_res["extracted"]["manifest"], c_run["results"]["extracted"]["manifest"])
    for name, version in (("C", find_version(registry, 1)), ("D", current(registry))):
        draft = str(version.draft)
        report[name] |= {"version": version.number, "draft": draft,
                         "narrow_heldout": heldout_acceptance(draft, h_run, heldout),
                         "same_kind_new": heldout_acceptance(draft, s_run, loop, same_kind)}
        print(f"{name}: version {version.number}, {json.dumps(report[name]['narrow_heldout'])} on H, "
              f"{json.dumps(report[name]['same_kind_new'])} on S", file=sys.stderr, flush=True)
    verifier = str(resolve(base["verifier"]["path"]))
    report["drift_noise"] = drift_noise(report["C"]["draft"], verifier, s_res["extracted"]["manifest"],
                                        s_res["prepared"]["path"], same_kind, loop, a.noise_draws)
    (out / "narrow-workload").mkdir(exist_ok=True)
    (out / "narrow-workload" / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "heldout_prompts"}, indent=1))


if __name__ == "__main__":
    main()
