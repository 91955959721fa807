"""Does the replayed acceptance length predict vLLM's? Score a draft on the very outputs vLLM produced
when it measured the draft, and print chained, replayed and measured side by side.

    python bench/replay_vs_vllm.py DRAFT_DIR VALIDATION_DIR [--work /tmp/replay-vs-vllm]

VALIDATION_DIR is a validation stage's folder (or bench/validate_returned_draft.py's): its
`reference.json` holds vLLM's greedy token ids for the MT-Bench first turns, its `report.json` the
measured acceptance. The answers are prepared with the verifier's chat template, extracted with the
transformers backend and scored with tasks.train.evaluation.evaluate_draft (k=3).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer  # noqa: E402

from tasks.common.demo_assets import ensure_asset  # noqa: E402
from tasks.extract.stage import ExtractJob, run_extraction  # noqa: E402
from tasks.prepare.stage import prepare  # noqa: E402
from tasks.train.acceptance import simulated_acceptance_length  # noqa: E402
from tasks.train.evaluation import evaluate_draft  # noqa: E402

K = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("draft", type=Path)
    p.add_argument("validation", type=Path)
    p.add_argument("--work", type=Path, default=Path("/tmp/replay-vs-vllm"))
    a = p.parse_args()

    verifier = str(ensure_asset("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    answers = json.loads((a.validation / "reference.json").read_text())["token_ids"]
    questions = [json.loads(line)["turns"][0] for line in Path(ensure_asset("mt-bench")).read_text().splitlines()
                 if line.strip()][:len(answers)]
    a.work.mkdir(parents=True, exist_ok=True)
    conversations = a.work / "answers.jsonl"
    conversations.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q},
        {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True).strip()}]}) + "\n"
        for q, ids in zip(questions, answers, strict=True)))
    prepared = prepare(verifier, [str(conversations)], a.work, max_seq_len=2048)
    extracted = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, verifier, str(a.work / "hs"),
                                          settings={"reserve_disk_gb": 1}), in_process=True)
    metrics = evaluate_draft(a.draft, extracted.manifest, prepared.path, ttt_steps=K, verifier=verifier)
    measured = json.loads((a.validation / "report.json").read_text())["live"]["draft"]
    rows = [("chained simulation", simulated_acceptance_length(metrics, K),
             [metrics[f"full_acc_{i}"] for i in range(K)]),
            ("replayed", metrics["replayed_acceptance_length"], [metrics[f"replayed_acceptance_{i}"] for i in range(K)]),
            ("vLLM, measured", measured["mean_acceptance_length"], measured["per_position_acceptance"])]
    for name, length, positions in rows:
        print(f"{name:<20} {length:.3f}  per position {', '.join(f'{x:.3f}' for x in positions)}")


if __name__ == "__main__":
    main()
