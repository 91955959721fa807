"""Where a draft loses acceptance: its replayed and chained acceptance length (k=3) on the verifier's
own greedy answers to the MT-Bench first turns, per MT-Bench category.

    python bench/mtbench_categories.py DRAFT [DRAFT ...] --mtbench question.jsonl [--work DIR --out OUT.json]

DRAFT is a draft folder (speculators' format: `config.json`, `model.safetensors`), e.g. the one
bench/validate_returned_draft.py reassembles under /tmp/returned-drafts/NAME/draft. The answers and
their hidden states are made once under --work (bench/recipe.py's scoring set: the verifier answers
greedily in float32, as vLLM's reference run here does; ~7 minutes on 2 cores) and reused by every
draft and later call. Replayed acceptance on these answers is what vLLM measures: 2.451 against vLLM's
2.443 for the same draft (docs/BENCHMARKS.md, by category). Prints one JSON object: per draft, per
category, the answers, their tokens (prompt and answer) and both figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.recipe import K, mtbench_set  # noqa: E402
from tasks.common.demo_assets import ensure_asset  # noqa: E402
from tasks.extract.shards import ShardReader  # noqa: E402
from tasks.train.acceptance import simulated_acceptance_length  # noqa: E402
from tasks.train.evaluation import evaluate_draft  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafts", nargs="+", type=Path)
    p.add_argument("--mtbench", type=Path, required=True)
    p.add_argument("--verifier", help="the verifier's folder (default: the demo's SmolLM2)")
    p.add_argument("--answer-tokens", type=int, default=256)
    p.add_argument("--work", type=Path, default=Path("/tmp/mtbench-categories"))
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    verifier = a.verifier or str(ensure_asset("smollm2-135m-instruct"))
    a.work.mkdir(parents=True, exist_ok=True)
    prepared, extracted, groups = mtbench_set(verifier, str(a.mtbench), a.work, 1024, a.answer_tokens,
                                              reuse_answers=True)
    lengths = ShardReader(extracted.manifest).lengths
    report = {}
    for draft in a.drafts:
        rows = {}
        for name, samples in {"all": sum(groups.values(), []), **groups}.items():
            # 2,048-token batches: the figures are counts, whatever the batching, and a CPU's dense
            # attention masks grow with the square of the batch
            m = evaluate_draft(draft, extracted.manifest, prepared.path, ttt_steps=K, total_seq_len=2048,
                               verifier=verifier, samples=samples)
            rows[name] = {"answers": len(samples), "tokens": sum(lengths[i] for i in samples),
                          "replayed": round(m["replayed_acceptance_length"], 3),
                          "chained": round(simulated_acceptance_length(m, K), 3)}
        report[str(draft)] = rows
    print(json.dumps(report, indent=1))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
