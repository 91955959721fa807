"""Several GPUs of one host against one: data-parallel extraction and DDP training, one run.

    python bench/scaling.py --gpus 2            # Llama-3.1-8B shapes, random bf16 weights (2 GPUs)
    python bench/scaling.py --gpus 2 --tiny     # a small verifier on CPU processes: checks the harness
    python bench/scaling.py --gpus 1            # one GPU: two identical runs, the noise floor of the ratios

Both halves run the pipeline's own multi-process code, not a copy of it:
- extraction: `tasks.extract.stage.run_extraction` with `workers` = 1, then `--gpus` (one process per GPU,
  shards by rank, one output folder), each run verified in full (every sample once, checksums) and
  the two outputs compared shard by shard. Rate: tokens over the longest worker's extraction time
  (from model loaded to last batch); `wall_s` adds loading and verification, which GPUs do not speed up;
- training: `tasks.train.stage.run_training` with `nproc` = 1 and `grad_accum_steps` = `--gpus`, then
  torchrun with `nproc` = `--gpus` and no accumulation: the same global batch and samples per step.
  Rate: median tokens/s of the steady-state windows; the loss of both runs at the last step.

Prints one JSON line with extract_scaling_<n>gpu (goal >= 1.9 for 2) and train_scaling_<n>gpu
(goal >= 1.8), the loss difference, and the raw rates.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extract_efficiency import LLAMA_8B, random_prepared  # noqa: E402
from train_speed import TINY  # noqa: E402

from tasks.common.workers import ProgressFile  # noqa: E402
from tasks.extract.shards import read_manifest  # noqa: E402
from tasks.extract.stage import ExtractJob, run_extraction  # noqa: E402
from tasks.train.job import TrainJob  # noqa: E402
from tasks.train.stage import run_training  # noqa: E402
from tasks.train.tracking import read_metrics  # noqa: E402
from tasks.vocab import build_vocab  # noqa: E402


def save_random_verifier(folder: Path, shape: dict, device: str) -> Path:
    """A verifier folder with random weights, loaded from disk by every worker like a real one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**shape, "architectures": ["LlamaForCausalLM"]})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def extract(verifier: Path, prepared_dir: Path, out: Path, workers: int, a) -> dict:
    settings = {"batch_tokens": a.batch_tokens, "shard_tokens": a.shard_tokens, "workers": workers,
                "reserve_disk_gb": 1}
    t0 = time.perf_counter()
    result = run_extraction(ExtractJob(str(prepared_dir), "bench", str(verifier), str(out), settings=settings))
    wall = time.perf_counter() - t0
    finals = [ProgressFile(out / "progress" / f"rank-{r}.jsonl").latest() for r in range(workers)]
    extract_s = max(e.elapsed_s for e in finals)
    return {"tokens_per_s": round(result.tokens / extract_s), "extract_s": round(extract_s, 1),
            "wall_s": round(wall, 1), "manifest": result.manifest}


def train(verifier: Path, prepared_dir: Path, manifest: str, vocab, aux: list[int], out: Path, nproc: int,
          accum: int, a) -> dict:
    settings = {"nproc": nproc, "grad_accum_steps": accum, "max_steps": a.steps, "epochs": 1000, "lr": 1e-4,
                "total_seq_len": a.total_seq_len, "log_every": a.log_every, "eval_every": 10**9,
                "val_fraction": 0.0, "seed": 0, "loader_workers": a.loader_workers}
    job = TrainJob(manifest, str(prepared_dir), vocab.path, str(verifier), str(out), aux, settings=settings)
    t0 = time.perf_counter()
    run_training(job, "bench", vocab.fingerprint)
    windows = [m for m in read_metrics(out) if m["split"] == "train"]
    rates = [m["tokens_per_s"] for m in windows]
    skip = min(a.warmup_windows, len(rates) - 1)
    return {"tokens_per_s": round(statistics.median(rates[skip:])), "windows": len(rates),
            "loss_last": windows[-1]["loss"], "step_last": windows[-1]["step"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--shard-tokens", type=int, default=65536)
    p.add_argument("--total-seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--warmup-windows", type=int, default=2, help="training windows left out (compilation)")
    p.add_argument("--loader-workers", type=int, default=4)
    p.add_argument("--out", default="/tmp/scaling-bench")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < a.gpus:
        raise SystemExit(f"--gpus {a.gpus} but {torch.cuda.device_count()} GPU(s) visible")
    shape = TINY if a.tiny else LLAMA_8B
    root = Path(a.out)
    shutil.rmtree(root, ignore_errors=True)
    verifier = save_random_verifier(root / "verifier", shape, device)
    prepared = random_prepared(root / "prepared", a.samples, a.seq_len, shape["vocab_size"])

    one = extract(verifier, root / "prepared", root / "extract-single", 1, a)
    many = extract(verifier, root / "prepared", root / "extract-parallel", a.gpus, a)
    shards_1, shards_n = read_manifest(one["manifest"])["shards"], read_manifest(many["manifest"])["shards"]
    same = sum(x["name"] == y["name"] and x["checksum"] == y["checksum"] for x, y in zip(shards_1, shards_n))
    print(f"extraction: 1 worker {one}, {a.gpus} workers {many}", flush=True)

    n = shape["num_hidden_layers"]
    aux = [2, n // 2, n - 3]
    vocab = build_vocab(str(root / "prepared"), "bench", str(verifier), root, min(32000, shape["vocab_size"]))
    single = train(verifier, root / "prepared", many["manifest"], vocab, aux, root / "train-single", 1, a.gpus, a)
    ddp = train(verifier, root / "prepared", many["manifest"], vocab, aux, root / "train-parallel", a.gpus, 1, a)
    print(json.dumps({
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu processes",
        "gpus": a.gpus, "verifier_shape": "tiny" if a.tiny else "Llama-3.1-8B", "tokens": sum(prepared["seq_len"]),
        f"extract_scaling_{a.gpus}gpu": round(many["tokens_per_s"] / one["tokens_per_s"], 3),
        "extract": {"single": one, "parallel": many, "shards_identical": f"{same}/{len(shards_1)}"},
        f"train_scaling_{a.gpus}gpu": round(ddp["tokens_per_s"] / single["tokens_per_s"], 3),
        "train": {"single": single, "parallel": ddp,
                  "loss_rel_diff": round(abs(ddp["loss_last"] - single["loss_last"]) / single["loss_last"], 5)},
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
