"""Drafts trained on fp8 shards against drafts trained on bf16 shards: SmolLM2-135M-Instruct on
ShareGPT (the demo assets), the same data, steps, seed and settings; only extract.storage_dtype differs.

    python bench/fp8_acceptance.py --rows 160 --max-seq-len 384 --steps 120 --out OUT

1. prepare --rows ShareGPT rows, extract them twice (bf16, fp8_e4m3) with the stage's own code;
   bytes on disk of each, and the fp8 states read back against the bf16 ones (per token and layer);
2. build the draft vocabulary, train one draft on each extraction (--val-fraction held out, by
   sample id: the same samples in both runs);
3. score both final drafts on the held-out samples read from the bf16 shards (the verifier's states
   as training would see them without fp8): simulated acceptance length with k=3.

Prints one JSON line with fp8_bytes_over_bf16 and fp8_acceptance_over_bf16 (goal: within 1%).
Extraction rates are compared side by side by bench/extract_efficiency.py --storage-dtypes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from tasks.common.demo_assets import ensure_asset  # noqa: E402
from tasks.extract.shards import ShardReader  # noqa: E402
from tasks.extract.stage import ExtractJob, run_extraction  # noqa: E402
from tasks.prepare.stage import prepare  # noqa: E402
from tasks.train.acceptance import simulated_acceptance_length  # noqa: E402
from tasks.train.data import split_indices  # noqa: E402
from tasks.train.evaluation import evaluate_draft  # noqa: E402
from tasks.train.job import TrainJob  # noqa: E402
from tasks.train.stage import run_training  # noqa: E402
from tasks.vocab import build_vocab  # noqa: E402

K = 3
DTYPES = ("bf16", "fp8_e4m3")


def round_trip(bf16_manifest: str, fp8_manifest: str) -> dict:
    """Per token and layer, the fp8 states read back against the bf16 ones of the same extraction."""
    exact, stored = ShardReader(bf16_manifest), ShardReader(fp8_manifest)
    errors, cosines = [], []
    for i in range(len(exact)):
        a, b = exact[i][1].float(), stored[i][1].float()
        errors.append(((b - a).norm(dim=-1) / a.norm(dim=-1)).flatten())
        cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=-1).flatten())
    e, c = torch.cat(errors), torch.cat(cosines)
    return {"relative_error_mean": round(e.mean().item(), 4), "relative_error_max": round(e.max().item(), 4),
            "cosine_mean": round(c.mean().item(), 5), "cosine_min": round(c.min().item(), 5)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/fp8-acceptance", help="prepared data, shards, drafts")
    p.add_argument("--out", required=True, help="folder for the JSON result")
    p.add_argument("--rows", type=int, default=160)
    p.add_argument("--max-seq-len", type=int, default=384)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--total-seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", action="store_true",
                   help="replace fp8_acceptance_over_bf16 in docs/benchmarks.json (bench/record.py)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    verifier = str(ensure_asset("smollm2-135m-instruct"))
    prepared = prepare(verifier, [str(ensure_asset("sharegpt"))], work, max_seq_len=a.max_seq_len, max_rows=a.rows)
    vocab = build_vocab(prepared.path, prepared.fingerprint, verifier, work, a.draft_vocab)

    extracted, timings, disk = {}, {}, {}
    for dtype in DTYPES:
        t0 = time.perf_counter()
        extracted[dtype] = run_extraction(ExtractJob(
            prepared.path, prepared.fingerprint, verifier, str(work / f"hs-{dtype}"),
            settings={"batch_tokens": 4096, "shard_tokens": 16384, "reserve_disk_gb": 1, "storage_dtype": dtype}))
        timings[f"extract_{dtype}_s"] = round(time.perf_counter() - t0, 1)
        manifest = json.loads(Path(extracted[dtype].manifest).read_text())
        disk[dtype] = sum((work / f"hs-{dtype}" / s["name"]).stat().st_size for s in manifest["shards"])

    settings = {"max_steps": a.steps, "epochs": 1000, "lr": a.lr, "total_seq_len": a.total_seq_len,
                "warmup_steps": 5, "log_every": 10, "eval_every": a.steps, "val_fraction": a.val_fraction,
                "seed": a.seed}
    _, held_out = split_indices(ShardReader(extracted["bf16"].manifest).sample_ids, a.val_fraction)
    scores = {}
    for dtype in DTYPES:
        t0 = time.perf_counter()
        result = run_training(TrainJob(extracted[dtype].manifest, prepared.path, vocab.path, verifier,
                                       str(work / f"train-{dtype}"), extracted[dtype].layers[:3], settings=settings),
                              extracted[dtype].fingerprint, vocab.fingerprint)
        timings[f"train_{dtype}_s"] = round(time.perf_counter() - t0, 1)
        metrics = evaluate_draft(result.draft_path, extracted["bf16"].manifest, prepared.path, ttt_steps=K,
                                 total_seq_len=a.total_seq_len, samples=held_out)
        scores[dtype] = {"simulated_acceptance_length": round(simulated_acceptance_length(metrics, K), 4),
                         "own_val_simulated_acceptance_length": result.simulated_acceptance_length,
                         **{k: round(v, 4) for k, v in metrics.items() if k.startswith(("cond_acc", "full_acc"))},
                         "steps": result.steps, "steady_tokens_per_s": result.steady_tokens_per_s}
    report = {
        "verifier": "SmolLM2-135M-Instruct", "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
        "rows": a.rows, "samples": extracted["bf16"].samples, "tokens": extracted["bf16"].tokens,
        "held_out_samples": len(held_out), "steps": a.steps, "total_seq_len": a.total_seq_len, "lr": a.lr,
        "seed": a.seed, "bytes": disk, "fp8_bytes_over_bf16": round(disk["fp8_e4m3"] / disk["bf16"], 4),
        "extract_steady_tokens_per_s": {d: extracted[d].steady_tokens_per_s for d in DTYPES},
        "scores": scores,
        "round_trip": round_trip(extracted["bf16"].manifest, extracted["fp8_e4m3"].manifest),
        "fp8_acceptance_over_bf16": round(scores["fp8_e4m3"]["simulated_acceptance_length"]
                                          / scores["bf16"]["simulated_acceptance_length"], 4),
        "timings": timings, "torch": torch.__version__,
    }
    (out / "fp8_acceptance.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    if a.record:
        record({"fp8_acceptance_over_bf16": {"value": report["fp8_acceptance_over_bf16"],
                                             "unit": "ratio of simulated acceptance lengths", "run": report}})


if __name__ == "__main__":
    main()
