"""Training speed: our loop against speculators' `Trainer`, same data, same draft, same GPU, one run.

    python bench/train_speed.py                 # Llama-3.1-8B shapes (hidden 4096, vocab 128256), GPU
    python bench/train_speed.py --tiny          # a small verifier, to check the harness quickly

Synthetic offline data (random hidden states, random tokens, 70% of tokens supervised) is written
once through our own shard writer and converted into speculators' offline layout
(`hidden_states/hs_<i>.safetensors` beside a `datasets` folder), so both trainers read the same
samples. Both train speculators' Eagle3DraftModel: 1 layer, full attention, draft vocabulary 32000
(the same d2t/t2d), TTT 3, kl_div with the eager loss (the fused one crashes under torch 2.11's
dynamo), AdamW, packed batches of --total-seq-len tokens, --workers loader processes.

Each trainer runs in a fresh process (torch.compile's caches and recompilation budget are per
process; a second trainer in the same process would inherit the first one's). Prints one JSON line:
train_speed_vs_speculators (ours tokens/s over theirs; goal >= 1.0, each the median over
steady-state steps) and train_peak_mem_gb of each; with --profile-steps, where our step's time goes.
`train_mfu` of each: the draft's matmul FLOPs per token (by count: 3 TTT steps of the decoder layer
and lm_head, the fc, forward and backward; the targets' head forward only) times tokens/s, over the
bf16 matmul rate measured here: how much of the GPU's arithmetic the step uses.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from tasks.extract.plan import ExtractionPlan, bf16_matmul_peak, plan_shards  # noqa: E402
from tasks.extract.shards import ShardReader  # noqa: E402
from tasks.extract.stage import write_manifest  # noqa: E402
from tasks.extract.writer import extract_shards  # noqa: E402
from tasks.prepare.dataset import load_prepared  # noqa: E402
from tasks.train.job import TrainJob  # noqa: E402
from tasks.train.loop import train_worker  # noqa: E402
from tasks.train.sizing import draft_flops_per_token  # noqa: E402
from tasks.train.tracking import read_metrics  # noqa: E402
from tasks.vocab import build_vocab  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=8192, max_position_embeddings=8192, tie_word_embeddings=False)
AUX = lambda n: [2, n // 2, n - 3]  # noqa: E731


class RandomStates:
    """Stands in for the verifier when making synthetic training data: random hidden states."""

    def __init__(self, hidden: int, device: str):
        self.hidden, self.device, self.model = hidden, device, object()

    def capture(self, batch: list[list[int]]) -> torch.Tensor:
        return torch.randn(sum(map(len, batch)), 4, self.hidden, device=self.device, dtype=torch.bfloat16)


def make_verifier(folder: Path, shape: dict) -> Path:
    """Config plus the three tensors both trainers read (embeddings, LM head, final norm)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    h, v = shape["hidden_size"], shape["vocab_size"]
    save_file({"model.embed_tokens.weight": torch.randn(v, h, dtype=torch.bfloat16) * 0.02,
               "lm_head.weight": torch.randn(v, h, dtype=torch.bfloat16) * 0.02,
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    return folder


def make_data(root: Path, verifier: Path, shape: dict, samples: int, seq_len: int, device: str):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (samples,), generator=g).tolist()
    ids = [torch.randint(0, shape["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    masks = [(torch.rand(n, generator=g) < 0.7).to(torch.int8).tolist() for n in lengths]
    prepared_dir = root / "prepared"
    Dataset.from_dict({"sample_id": [f"s{i}" for i in range(samples)], "input_ids": ids, "loss_mask": masks,
                       "seq_len": lengths}).save_to_disk(str(prepared_dir / "data"))
    prepared = load_prepared(prepared_dir)
    from tasks.common.verifier import inspect_verifier, verifier_fingerprint

    info = inspect_verifier(verifier)
    layers = AUX(info.num_layers) + [info.num_layers]
    plan = ExtractionPlan("bench", str(verifier), verifier_fingerprint(verifier), layers, info.hidden_size, samples, sum(lengths),
                          plan_shards(prepared, "bench", 1 << 20))
    hs = root / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    extract_shards(plan.shards, plan, prepared, hs, RandomStates(info.hidden_size, device), batch_tokens=1 << 16)
    manifest = write_manifest(plan, "bench", hs, lengths)
    # the same samples in speculators' offline layout
    theirs = root / "speculators"
    reader = ShardReader(manifest)
    from safetensors.torch import save_file

    (theirs / "hidden_states").mkdir(parents=True, exist_ok=True)
    row = {sid: i for i, sid in enumerate(prepared["sample_id"])}
    for i in range(len(reader)):
        tokens, states = reader[i]
        save_file({"hidden_states": states.contiguous(), "token_ids": tokens},
                  str(theirs / "hidden_states" / f"hs_{row[reader.sample_ids[i]]}.safetensors"))
    Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": lengths}).with_format("torch").save_to_disk(
        str(theirs))
    vocab = build_vocab(str(prepared_dir), "bench", str(verifier), root, 32000)
    return prepared_dir, manifest, vocab, theirs, layers[:3]


def steady(values: list[float], skip: int) -> float:
    return statistics.median(values[skip:] if len(values) > skip else values)


def run_speculators(verifier: Path, data: Path, vocab, aux: list[int], out: Path, a) -> dict:
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    records: list[dict] = []

    class Capture(logging.Handler):
        def emit(self, record):
            if record.name == "speculators.metrics" and isinstance(record.msg, dict) and record.msg.get("profile"):
                records.append(record.msg["profile"])

    # On the root logger: speculators' dictConfig replaces the handlers of its own loggers, and
    # "speculators.metrics" propagates.
    capture = Capture()
    logging.getLogger().addHandler(capture)
    argv = ["--verifier-name-or-path", str(verifier), "--data-path", str(data), "--save-path", str(out),
            "--d2t-path", str(Path(vocab.path) / "d2t.npy"), "--t2d-path", str(Path(vocab.path) / "t2d.npy"),
            "--draft-vocab-size", str(vocab.draft_vocab_size), "--target-layer-ids", *map(str, aux), "--full-attention-indices", "0",
            "--no-norm-before-fc", "--no-norm-output", "--mask-token-id", "0",
            "--total-seq-len", str(a.total_seq_len), "--epochs", "1", "--max-steps", str(a.steps),
            "--optimizer", "adamw", "--lr", str(a.lr), "--weight-decay", "0.0", "--loss-implementation", "eager",
            "--num-workers", str(a.workers), "--log-freq", "1", "--train-data-ratio", "0.98",
            "--on-missing", "raise", "--seed", "0"]
    if not torch.cuda.is_available():  # a harness check on CPU (the Trainer itself needs a GPU to run)
        argv += ["--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32"]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        speculators_train(TrainConfig.resolve(argv))
    finally:
        logging.getLogger().removeHandler(capture)
    wall = time.perf_counter() - t0
    rates = [r["tokens_per_s"] for r in records]
    return {"tokens_per_s": steady(rates, a.warmup_steps), "steps": len(rates), "wall_s": round(wall, 1),
            "peak_mem_gb": peak_gb()}


def peak_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def run_ours(verifier: Path, prepared: Path, manifest: Path, vocab, aux: list[int], out: Path, a) -> dict:
    settings = {"max_steps": a.steps, "epochs": 1000, "optimizer": "adamw", "lr": a.lr, "weight_decay": 0.0,
                "total_seq_len": a.total_seq_len, "log_every": a.log_every, "eval_every": 10**9,
                "val_fraction": 0.0, "loader_workers": a.workers, "seed": 0, "profile_steps": a.profile_steps}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train_worker(TrainJob(str(manifest), str(prepared), vocab.path, str(verifier), str(out), aux, settings=settings))
    wall = time.perf_counter() - t0
    rates = [m["tokens_per_s"] for m in read_metrics(out) if m["split"] == "train"]
    result = {"tokens_per_s": steady(rates, max(1, a.warmup_steps // a.log_every)), "windows": len(rates),
              "wall_s": round(wall, 1), "peak_mem_gb": peak_gb()}
    if a.profile_steps:
        result["profile"] = json.loads((out / "profile.json").read_text())
    return result


def in_fresh_process(trainer: str, argv: list[str]) -> dict:
    """One trainer in its own Python process; its result is the last line it prints."""
    cmd = [sys.executable, __file__, "--trainer", trainer, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{trainer} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--total-seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the median (compilation)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", default="/tmp/train-speed-bench")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many of our steady-state steps (train.profile_steps; the median is over the rest)")
    p.add_argument("--ours-only", action="store_true",
                   help="skip speculators' Trainer (e.g. to profile our loop alone): no ratio is reported")
    p.add_argument("--record", action="store_true",
                   help="replace train_speed_vs_speculators (both trainers must run) in docs/benchmarks.json (bench/record.py)")
    p.add_argument("--trainer", choices=["ours", "speculators"], help=argparse.SUPPRESS)  # the worker processes
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(a.out)
    if a.trainer:
        d = json.loads((root / "bench.json").read_text())
        vocab = argparse.Namespace(**d["vocab"])  # path, draft_vocab_size
        out = root / f"{a.trainer}-out"
        shutil.rmtree(out, ignore_errors=True)  # each run from scratch: a finished one would resume and train nothing
        if a.trainer == "ours":
            result = run_ours(Path(d["verifier"]), Path(d["prepared"]), Path(d["manifest"]), vocab, d["aux"], out, a)
        else:
            result = run_speculators(Path(d["verifier"]), Path(d["theirs"]), vocab, d["aux"], out, a)
        print(json.dumps(result))
        return
    shape = TINY if a.tiny else LLAMA_8B
    verifier = make_verifier(root / "verifier", shape)
    t0 = time.perf_counter()
    prepared, manifest, vocab, theirs, aux = make_data(root, verifier, shape, a.samples, a.seq_len, device)
    data_s = time.perf_counter() - t0
    (root / "bench.json").write_text(json.dumps({
        "verifier": str(verifier), "prepared": str(prepared), "manifest": str(manifest), "theirs": str(theirs),
        "aux": aux, "vocab": {"path": vocab.path, "draft_vocab_size": vocab.draft_vocab_size}}))
    print(f"data: {data_s:.0f} s", flush=True)
    speculators_result = None if a.ours_only else in_fresh_process("speculators", sys.argv[1:])
    print(f"speculators: {json.dumps(speculators_result)}", flush=True)  # kept if the run is cut short
    ours = in_fresh_process("ours", sys.argv[1:])
    print(f"ours: {json.dumps(ours)}", flush=True)
    flops = draft_flops_per_token(shape, vocab.draft_vocab_size)
    peak = bf16_matmul_peak(device)
    for result in filter(None, (ours, speculators_result)):
        result["train_mfu"] = round(result["tokens_per_s"] * flops / peak, 3)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "draft_gflops_per_token": round(flops / 1e9, 3), "matmul_peak_tflops": round(peak / 1e12, 1),
        "verifier_shape": "Llama-3.1-8B" if not a.tiny else "tiny", "samples": a.samples, "seq_len": a.seq_len,
        "total_seq_len": a.total_seq_len, "steps": a.steps, "data_s": round(data_s, 1),
        "ours": ours, "speculators": speculators_result,
        "train_speed_vs_speculators": round(ours["tokens_per_s"] / speculators_result["tokens_per_s"], 3)
        if speculators_result else None,
        "torch": torch.__version__,
    }
    print(json.dumps(report))
    if a.record and speculators_result:
        record({"train_speed_vs_speculators": {
            "value": report["train_speed_vs_speculators"], "unit": "ratio of steady-state tokens/s",
            "ours_tokens_per_s": ours["tokens_per_s"], "speculators_tokens_per_s": speculators_result["tokens_per_s"],
            "run": report}})


if __name__ == "__main__":
    main()
