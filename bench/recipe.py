"""Recipe ablations: variants of the draft's training side by side on one extraction, scored by the
simulated acceptance length (k=3) on the verifier's own answers to the MT-Bench first turns.

    python bench/recipe.py TRAIN_DIR --steps 1000 --variant base --variant ttt7 train.ttt_steps=7 \
        --variant lr1e-3 train.lr=1e-3 --variant no-eot data.supervise_end_of_turn=false \
        --conversations RUN/regenerated/FP/conversations.jsonl --mtbench question.jsonl --out OUT

TRAIN_DIR is the train stage's folder of a finished pipeline run (`<output_dir>/train/<fp>/`): its
`job.json` names the run's prepared data, extraction, vocabulary and settings, which every variant
reuses (a `data.*` override re-prepares --conversations, the run's own chat data, with that setting:
only loss masks may differ, the tokens and so the hidden states are the same; an `extract.*`
override, e.g. extract.storage_dtype=fp8_e4m3, extracts the run's samples again with it, into
--work; a `vocab.draft_vocab_size` override builds the draft vocabulary again at that size from the
run's prepared data). A variant is the run's train settings with its overrides and
--steps optimizer steps (cosine schedule over those steps), trained in its own process; all variants
train at once on the one GPU (a small draft leaves it underused). Reported per variant, and for the
run's own draft: the held-out validation curve (simulated acceptance length with k=3 against step,
from the training's own validation log, whatever its ttt_steps) and the final draft's simulated
acceptance length on the verifier's greedy answers to the MT-Bench first turns. With --return, every
scored draft is also written to OUT/drafts/NAME/ for bench/validate_returned_draft.py, without the
tensors it copies from the verifier (about 10 MB for SmolLM2). --variants-only scores the variants
and does not wait for the run's training (a run trained for one step only to give them its data).
Started while the run still trains (its job.json is written when training starts), the variants train
alongside it and the run's draft is scored once its training has written result.json. If the run's
training stops without writing it (no live process holds TRAIN_DIR's lock any more), or --wait-s
passes, recipe.json keeps the variants' figures alone and the command exits non-zero saying why.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import answer_mtbench, split_for_return  # noqa: E402
from flows.cli import parse_overrides  # noqa: E402
from tasks.common.config import TrainSettings  # noqa: E402
from tasks.common.folder_lock import held_by_live_process  # noqa: E402
from tasks.extract.shards import ShardReader  # noqa: E402
from tasks.extract.stage import ExtractJob, run_extraction  # noqa: E402
from tasks.prepare.stage import prepare  # noqa: E402
from tasks.train.acceptance import simulated_acceptance_length  # noqa: E402
from tasks.train.evaluation import evaluate_draft  # noqa: E402
from tasks.train.job import TrainJob  # noqa: E402
from tasks.train.stage import run_training  # noqa: E402
from tasks.train.tracking import read_metrics  # noqa: E402
from tasks.vocab import build_vocab  # noqa: E402

K = 3  # vLLM's num_speculative_tokens in the validation stage
# How long the run's train folder may stay unlocked before its training counts as failed: the
# train stage's retries start again after 10 and 20 s (flows/stages.py GPU_STAGE), re-taking the lock.
UNLOCKED_GRACE_S = 120


def validation_curve(train_dir: Path) -> list[tuple[int, float]]:
    """(step, simulated acceptance length with k=3) of each held-out validation in a training log."""
    return [(m["step"], round(simulated_acceptance_length(m, K), 4))
            for m in read_metrics(train_dir) if m["split"] == "val"]


def mtbench_set(verifier: str, questions: str, work: Path, max_seq_len: int, answer_tokens: int,
                reuse_answers: bool = False):
    """The verifier's greedy MT-Bench answers, prepared and extracted: the scoring set (`reuse_answers`:
    the answers an earlier call wrote under `work` for the same verifier, questions and length, if any)."""
    from tasks.common.verifier import verifier_fingerprint

    answers, made_by = work / "mtbench_answers.jsonl", work / "mtbench_answers.made_by.json"
    wanted = {"verifier": verifier_fingerprint(verifier), "questions": Path(questions).read_text(),
              "answer_tokens": answer_tokens}
    if not (reuse_answers and answers.exists() and made_by.exists() and json.loads(made_by.read_text()) == wanted):
        answers = answer_mtbench(verifier, questions, work, answer_tokens)
        made_by.write_text(json.dumps(wanted))
    prepared = prepare(verifier, [str(answers)], work / "mtbench", max_seq_len=max_seq_len)
    extracted = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, verifier, str(work / "mtbench-hs"),
                                          settings={"reserve_disk_gb": 1}), in_process=True)
    return prepared, extracted, samples_by_category(Path(questions), answers, extracted.manifest)


def samples_by_category(questions: Path, answers: Path, manifest: str) -> dict[str, list[int]]:
    """The scoring set's extracted samples (manifest rows) of each MT-Bench category. An answers row
    is `mtbench_answers.jsonl:<line>` (tasks/prepare/chat_data.py) and names its question by its user turn."""
    category = {}
    for line in questions.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            category[q["turns"][0]] = q["category"]
    rows = [json.loads(line) for line in answers.read_text().splitlines() if line.strip()]
    groups = defaultdict(list)
    for i, sample_id in enumerate(ShardReader(manifest).sample_ids):
        groups[category[rows[int(sample_id.rsplit(":", 1)[1])]["messages"][0]["content"]]].append(i)
    return dict(sorted(groups.items()))


def score(draft: Path, scoring) -> dict:
    """A draft's acceptance on the scoring set, over all of it and per MT-Bench category (replayed)."""
    prepared, extracted, categories = scoring
    metrics = evaluate_draft(draft, extracted.manifest, prepared.path, ttt_steps=K)
    by_category = {name: round(evaluate_draft(draft, extracted.manifest, prepared.path, ttt_steps=K, samples=samples)
                               ["replayed_acceptance_length"], 4) for name, samples in categories.items()}
    return {"mtbench_simulated_acceptance_length": round(simulated_acceptance_length(metrics, K), 4),
            "mtbench_replayed_acceptance_length": round(metrics["replayed_acceptance_length"], 4),
            "mtbench_replayed_by_category": by_category,
            **{k: round(v, 4) for k, v in metrics.items() if k.startswith(("cond_acc", "replayed_acceptance_"))}}


def wait_for_run(train_dir: Path, wait_s: float, poll_s: float = 15,
                 unlocked_grace_s: float = UNLOCKED_GRACE_S) -> str | None:
    """Wait for the run's training to write TRAIN_DIR/result.json: None once it has, else why it
    never will (no live process has held the folder's lock for `unlocked_grace_s`, or `wait_s` passed)."""
    result = train_dir / "result.json"
    start, unlocked_since = time.monotonic(), None
    while not result.exists():
        now = time.monotonic()
        if held_by_live_process(train_dir) is False:
            unlocked_since = now if unlocked_since is None else unlocked_since
            if now - unlocked_since >= unlocked_grace_s:
                return (f"the run's training stopped without writing {result}: no live process has held "
                        f"{train_dir} for {now - unlocked_since:.0f} s (the run's own log says why)")
        else:
            unlocked_since = None
        if now - start >= wait_s:
            return f"the run's training did not write {result} within --wait-s {wait_s:.0f} s"
        logging.info("waiting for the run's training to finish (%s)", result)
        time.sleep(poll_s)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("train_dir", type=Path)
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                   help="a variant: its name, then train.<setting>=<value> overrides (repeatable)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--conversations", help="the run's chat data (for variants with data.* overrides)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="the run's data.max_seq_len")
    p.add_argument("--mtbench", required=True, help="MT-Bench question.jsonl")
    p.add_argument("--answer-tokens", type=int, default=256)
    p.add_argument("--work", type=Path, default=Path("/tmp/recipe-bench"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--return", dest="return_draft", action="store_true",
                   help="also write every scored draft to OUT/drafts/NAME/ (bench/validate_returned_draft.py)")
    p.add_argument("--variants-only", action="store_true", help="score the variants alone; do not wait for the run")
    p.add_argument("--wait-s", type=float, default=7200,
                   help="how long to wait, after the variants, for the run's training to write result.json")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    run = TrainJob(**json.loads((a.train_dir / "job.json").read_text()))
    t0 = time.perf_counter()

    def train(name: str, overrides: list[str]):
        extra = parse_overrides(overrides)
        prepared_path, manifest, vocab_path = run.prepared_path, run.manifest, run.vocab_path
        if extra.get("data"):  # same rows and tokens, other loss masks
            if not a.conversations:
                raise SystemExit(f"variant {name} overrides data settings: give --conversations")
            prepared_path = prepare(run.verifier_path, [a.conversations], a.work / name, max_seq_len=a.max_seq_len,
                                    **extra["data"]).path
        if extra.get("extract"):  # the run's samples extracted again, e.g. stored in fp8
            run_manifest = json.loads(Path(run.manifest).read_text())
            manifest = run_extraction(ExtractJob(
                run.prepared_path, run_manifest["prepared_fingerprint"], run.verifier_path, str(a.work / name / "hs"),
                trust_remote_code=run.trust_remote_code,
                settings={"aux_layers": run.aux_layers, "reserve_disk_gb": 1, **extra["extract"]}), in_process=True).manifest
        if extra.get("vocab"):  # the draft vocabulary at another size, from the run's own data
            run_manifest = json.loads(Path(run.manifest).read_text())
            vocab_path = build_vocab(run.prepared_path, run_manifest["prepared_fingerprint"], run.verifier_path,
                                     a.work / name, **extra["vocab"]).path
        settings = TrainSettings.model_validate({**run.settings, **extra.get("train", {}), "max_steps": a.steps,
                                                 "epochs": 1000, "eval_every": a.eval_every,
                                                 "loader_workers": a.loader_workers})
        job = TrainJob(**{**asdict(run), "prepared_path": prepared_path, "manifest": manifest, "vocab_path": vocab_path,
                          "out_dir": str(a.work / "variants" / name),
                          "settings": settings.model_dump()})
        t = time.perf_counter()
        result = run_training(job, "", "")
        return {"overrides": extra, "steps": result.steps, "best_step": result.best_step,
                "steady_tokens_per_s": result.steady_tokens_per_s, "train_s": round(time.perf_counter() - t, 1),
                "validation_curve": validation_curve(Path(job.out_dir)), "draft": result.draft_path}

    with ThreadPoolExecutor(max(len(a.variant), 1)) as pool:
        futures = {v[0]: pool.submit(train, v[0], v[1:]) for v in a.variant}
        scoring = mtbench_set(run.verifier_path, a.mtbench, a.work, 2048, a.answer_tokens)
        variants = {name: f.result() for name, f in futures.items()}
    variants_s = round(time.perf_counter() - t0, 1)
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "steps": a.steps, "variants_wall_s": variants_s,
               "mtbench_answers": scoring[0].rows,
               "results": {name: {**v, **score(Path(v.pop("draft")), scoring)} for name, v in variants.items()}}
    if a.return_draft:
        for name, r in summary["results"].items():
            r["returned"] = return_draft(a.work / "variants" / name / "draft", a.out / "drafts" / name, r)
    report(summary, a.out)  # the variants' figures are safe before waiting for the run
    if a.variants_only:
        return

    given_up = wait_for_run(a.train_dir, a.wait_s)
    if given_up:
        raise SystemExit(f"{given_up}; {a.out / 'recipe.json'} has the variants' figures, without the run's draft")
    summary["results"] = {"run": {"settings": run.settings, "validation_curve": validation_curve(a.train_dir),
                                  **score(a.train_dir / "draft", scoring)}, **summary["results"]}
    if a.return_draft:
        run_scores = summary["results"]["run"]
        run_scores["returned"] = return_draft(a.train_dir / "draft", a.out / "drafts" / "run", run_scores)
    report(summary, a.out)


def return_draft(draft: Path, out: Path, scored: dict) -> list[str]:
    """The draft's files for bench/validate_returned_draft.py, with its MT-Bench scores beside them."""
    out.mkdir(parents=True, exist_ok=True)
    parts = split_for_return(draft, out)
    (out / "acceptance.json").write_text(json.dumps({"ours": {
        "simulated_acceptance_length": scored["mtbench_simulated_acceptance_length"],
        "replayed_acceptance_length": scored["mtbench_replayed_acceptance_length"]}}))
    return parts


def report(summary: dict, out: Path) -> None:
    """Write OUT/recipe.json and print one line per variant."""
    (out / "recipe.json").write_text(json.dumps(summary, indent=1))
    print(f"{'variant':<12} {'MT-Bench sim tau':>16} {'replayed':>9}  validation curve (step: tau, k={K})", flush=True)
    for name, r in summary["results"].items():
        curve = ", ".join(f"{s}: {t:.3f}" for s, t in r["validation_curve"][-6:])
        print(f"{name:<12} {r['mtbench_simulated_acceptance_length']:>16.4f} "
              f"{r['mtbench_replayed_acceptance_length']:>9.4f}  {curve}", flush=True)


if __name__ == "__main__":
    main()
