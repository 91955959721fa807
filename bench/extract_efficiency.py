"""Extraction efficiency: our extraction's tokens/s (capture + shard writes, the real code path)
over the bare forward tokens/s of the same model on the same batches, measured in one run.

    python bench/extract_efficiency.py                       # SmolLM2 on ShareGPT rows, this machine
    python bench/extract_efficiency.py --random-llama-8b     # Llama-3.1-8B shapes, random bf16 weights (GPU)
    python bench/extract_efficiency.py --storage-dtypes bf16 fp8_e4m3   # both storage dtypes, side by side

    python bench/extract_efficiency.py --random-llama-8b --compile   # and with compiled decoder layers

Prints one JSON line: extract_efficiency (goal >= 0.95: ours over the bare forward of the same
padded batches), extract_vs_best_forward (goal >= 0.95: ours over the best forward this GPU does on
the same tokens, the faster of eager and compiled, in fixed-length batches with no padding at all),
bytes_real_over_planned, extract_mfu (achieved FLOP/s over the measured bf16 matmul peak), and the
raw rates. With several storage dtypes (extract.storage_dtype), each is extracted twice, in
alternating order, between the bare forwards of one loaded model; the first dtype's figures are the
top-level ones, every dtype's are under `storage_dtypes`, with fp8_bytes_over_bf16 and
fp8_rate_over_bf16. With --compile the decoder layers are then compiled (extract.compile) and each
dtype is extracted twice more (`compiled`; per dtype, with several, under `compiled.storage_dtypes`),
next to the compiled fixed-length forward; the compiled states are compared with the eager ones of
the same batches (cosine per token).

Each extraction's rate is also given without its last shard's write after the last batch was computed
(`without_last_write_*`, the writer's own measurement): a run writes that shard after its compute
whatever its length, so a run of thousands of shards does not see it, where this bench's few shards
see it on every run (at 65,536-token shards, ~2 GB in bf16 at 8B shapes: ~1.5 s of a ~12-s run).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from tasks.common.demo_assets import ensure_asset  # noqa: E402
from tasks.common.verifier import inspect_verifier  # noqa: E402
from tasks.extract.backends.hf import TransformersBackend  # noqa: E402
from tasks.extract.plan import ExtractionPlan, bf16_matmul_peak, plan_shards  # noqa: E402
from tasks.extract.writer import batches, extract_shards  # noqa: E402
from tasks.prepare.dataset import load_prepared  # noqa: E402
from tasks.prepare.stage import prepare  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"], model_type="llama")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class LastWriteTimes(logging.Handler):
    """The writer's figures of each extraction (extract_shards puts them on its summary's record):
    `last_write_s`, the last shard's write after all states were computed, is paid once a run."""

    def __init__(self):
        super().__init__()
        self.last_write_s = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "writer_summary"):
            self.last_write_s = record.writer_summary["last_write_s"]


def random_verifier(folder: Path, device: str) -> tuple[Path, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_8B)
    config.save_pretrained(folder)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return folder, model


def random_prepared(folder: Path, samples: int, seq_len: int, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (samples,), generator=g).tolist()
    rows = {"sample_id": [f"s{i}" for i in range(samples)],
            "input_ids": [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths],
            "loss_mask": [[1] * n for n in lengths], "seq_len": lengths}
    Dataset.from_dict(rows).save_to_disk(str(folder / "data"))
    return load_prepared(folder)


def rates(runs: list[tuple[float, float]]) -> dict:
    """An extraction's repeated runs: the best one's tokens/s, whole and without its last write."""
    best = max(runs)
    return {"extract_tokens_per_s": round(best[0]), "runs_tokens_per_s": [round(w) for w, _ in runs],
            "without_last_write_tokens_per_s": round(best[1])}


def against(rate: dict, best_forward: float) -> dict:
    return {"extract_vs_best_forward": round(rate["extract_tokens_per_s"] / best_forward, 3),
            "without_last_write_vs_best_forward": round(rate["without_last_write_tokens_per_s"] / best_forward, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-llama-8b", action="store_true")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--shard-tokens", type=int, default=65536)
    p.add_argument("--out", default=None, help="where shards go (default: a temporary folder on this disk)")
    p.add_argument("--storage-dtypes", nargs="+", choices=["bf16", "fp8_e4m3"], default=["bf16"])
    p.add_argument("--compile", action="store_true", help="also measure with compiled decoder layers")
    p.add_argument("--record", action="store_true",
                   help="replace extract_vs_best_forward, extract_mfu and, with both dtypes, fp8_bytes_over_bf16 in docs/benchmarks.json (bench/record.py)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("tasks.extract.writer").setLevel(logging.INFO)  # the writer's disk statistics
    last_write = LastWriteTimes()
    logging.getLogger("tasks.extract.writer").addHandler(last_write)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(a.out or tempfile.mkdtemp(prefix="extract-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.random_llama_8b:
        path, model = random_verifier(work / "verifier", device)
        prepared = random_prepared(work / "prepared", a.samples, a.seq_len, LLAMA_8B["vocab_size"])
        params = sum(p.numel() for p in model.parameters()) - LLAMA_8B["vocab_size"] * LLAMA_8B["hidden_size"]
    else:
        path = ensure_asset("smollm2-135m-instruct")
        result = prepare(str(path), [str(ensure_asset("sharegpt"))], work, max_seq_len=a.seq_len, max_rows=a.samples)
        prepared = load_prepared(result.path)
        model = None
    verifier = inspect_verifier(path)
    layers = verifier.default_aux_layers + [verifier.num_layers]
    backend = TransformersBackend(verifier, layers, "bfloat16", device)
    if model is None:
        backend.load()
        model = backend.model
        params = sum(p.numel() for p in model.parameters()) - verifier.vocab_size * verifier.hidden_size
    else:
        backend.attach(model)
    plans = {d: ExtractionPlan("bench", str(path), "bench", layers, verifier.hidden_size, len(prepared),
                               sum(prepared["seq_len"]), plan_shards(prepared, "bench", a.shard_tokens), storage_dtype=d)
             for d in a.storage_dtypes}
    plan = plans[a.storage_dtypes[0]]
    lengths, ids = prepared["seq_len"], prepared["input_ids"]
    all_batches = [[ids[r] for r in b] for s in plan.shards for b in batches(s, lengths, a.batch_tokens)]

    def bare_forward() -> float:
        """The same batches through the same decoder (right-padded, no mask, as extraction runs
        them), nothing gathered, nothing written."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for batch in all_batches:
                n = max(len(x) for x in batch)
                x = torch.tensor([s + [0] * (n - len(s)) for s in batch], device=backend.input_device)
                backend.decoder(input_ids=x, use_cache=False)
        sync(device)
        return plan.tokens / (time.perf_counter() - t0)

    # The best case for these tokens: all of them, back to back, in rows of the longest sample's
    # length and batches of --batch-tokens: no padding, one shape.
    stream = torch.tensor([t for r in range(len(prepared)) for t in ids[r]])
    row_len = max(lengths)
    per_batch = max(1, a.batch_tokens // row_len)
    fixed = stream[: len(stream) // row_len * row_len].view(-1, row_len).split(per_batch)

    def fixed_forward() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for x in fixed:
                backend.decoder(input_ids=x.to(backend.input_device, non_blocking=True), use_cache=False)
        sync(device)
        return sum(x.numel() for x in fixed) / (time.perf_counter() - t0)

    def states_of_some_batches() -> list[torch.Tensor]:
        return [backend.capture(b).float().cpu() for b in all_batches[:: max(1, len(all_batches) // 4)]]

    def cosine_to(reference: list[torch.Tensor], states: list[torch.Tensor]) -> dict:
        cos = [torch.nn.functional.cosine_similarity(e, c, dim=-1) for e, c in zip(reference, states, strict=True)]
        return {"cosine_to_eager_min": round(min(c.min().item() for c in cos), 5),
                "cosine_to_eager_mean": round(sum(c.sum().item() for c in cos) / sum(c.numel() for c in cos), 6)}

    def extraction(dtype: str) -> tuple[float, float]:
        """(tokens/s of the whole call, tokens/s without the last shard's write after the last batch was
        computed: a run of many shards pays that once, this bench's few shards pay it on every run)."""
        out = work / f"hidden_states-{dtype}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        t0 = time.perf_counter()
        extract_shards(plans[dtype].shards, plans[dtype], prepared, out, backend, batch_tokens=a.batch_tokens)
        elapsed = time.perf_counter() - t0
        return plan.tokens / elapsed, plan.tokens / (elapsed - last_write.last_write_s)

    bare_forward()  # warm-up (allocator, kernels)
    fwd = [bare_forward()]
    best = {"eager": fixed_forward()}
    ext: dict[str, list[tuple[float, float]]] = {d: [] for d in a.storage_dtypes}
    for order in (a.storage_dtypes, a.storage_dtypes[::-1]):  # alternating: drift in the machine's speed cancels
        for d in order:
            ext[d].append(extraction(d))
        fwd.append(bare_forward())
    best["eager"] = max(best["eager"], fixed_forward())
    bare = sorted(fwd)[len(fwd) // 2]
    compiled = None
    if a.compile:
        eager_states = states_of_some_batches()
        t0 = time.perf_counter()
        backend.compile_layers()
        fixed_forward()  # compiles (symbolic shapes: once for every batch shape)
        compile_s = time.perf_counter() - t0
        similarity = cosine_to(eager_states, states_of_some_batches())
        best["compiled"] = fixed_forward()
        runs: dict[str, list[tuple[float, float]]] = {d: [] for d in a.storage_dtypes}
        for order in (a.storage_dtypes, a.storage_dtypes[::-1]):
            for d in order:
                runs[d].append(extraction(d))
        best["compiled"] = max(best["compiled"], fixed_forward())
        compiled = {**rates(runs[a.storage_dtypes[0]]), "bare_forward_tokens_per_s": round(bare_forward()),
                    "compile_s": round(compile_s, 1), **similarity}
    best_forward = max(best.values())
    per_dtype = {}
    for d, p_ in plans.items():
        real_bytes = sum(f.stat().st_size for f in (work / f"hidden_states-{d}").glob("shard-*.safetensors"))
        r = rates(ext[d])
        per_dtype[d] = {**r, "extract_efficiency": round(r["extract_tokens_per_s"] / bare, 3), "bytes": real_bytes,
                        "bytes_real_over_planned": round(real_bytes / p_.bytes_total, 4)}
    top = rates(ext[a.storage_dtypes[0]])
    ours = top["extract_tokens_per_s"]
    peak = bf16_matmul_peak(device)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu x{torch.get_num_threads()}",
        "verifier": "random Llama-3.1-8B shapes" if a.random_llama_8b else "SmolLM2-135M-Instruct",
        "tokens": plan.tokens, "batches": len(all_batches), "shards": len(plan.shards),
        "bare_forward_tokens_per_s": round(bare), "extract_tokens_per_s": round(ours),
        "extract_efficiency": round(ours / bare, 3),
        "best_forward_tokens_per_s": {k: round(v) for k, v in best.items()},
        "fixed_batches": f"{len(fixed)} x {per_batch} rows x {row_len} tokens",
        **against(top, best_forward),
        "bytes_real_over_planned": per_dtype[a.storage_dtypes[0]]["bytes_real_over_planned"],
        "extract_mfu": round(2 * params * ours / peak, 3), "matmul_peak_tflops": round(peak / 1e12, 1),
        "torch": torch.__version__,
    }
    if compiled:
        report["compiled"] = {**compiled, **against(compiled, best_forward)}
        if len(runs) > 1:  # each storage dtype's compiled extraction against the same best forward
            report["compiled"]["storage_dtypes"] = {d: {**rates(r), **against(rates(r), best_forward)}
                                                    for d, r in runs.items()}
    if len(per_dtype) > 1:
        report["bare_forward_runs_tokens_per_s"] = [round(x) for x in fwd]
        report["storage_dtypes"] = per_dtype
        if {"bf16", "fp8_e4m3"} <= per_dtype.keys():
            fp8, bf16 = per_dtype["fp8_e4m3"], per_dtype["bf16"]
            report["fp8_bytes_over_bf16"] = round(fp8["bytes"] / bf16["bytes"], 4)
            report["fp8_rate_over_bf16"] = round(fp8["extract_tokens_per_s"] / bf16["extract_tokens_per_s"], 3)
    print(json.dumps(report))
    if a.record:
        best_ratio = report["compiled"] if compiled else report
        figures = {"extract_vs_best_forward": {
                       "value": best_ratio["extract_vs_best_forward"], "unit": "ratio of tokens/s",
                       "without_last_write_value": best_ratio["without_last_write_vs_best_forward"],
                       "eager_value": report["extract_vs_best_forward"],
                       "storage_dtype": a.storage_dtypes[0], "run": report},
                   "extract_mfu": {"value": report["extract_mfu"], "unit": "fraction of the measured bf16 matmul peak",
                                   "matmul_peak_tflops": report["matmul_peak_tflops"]}}
        if "fp8_bytes_over_bf16" in report:
            figures["fp8_bytes_over_bf16"] = {"value": report["fp8_bytes_over_bf16"], "unit": "ratio of bytes on disk",
                                              "fp8_rate_over_bf16": report["fp8_rate_over_bf16"],
                                              "storage_dtypes": report["storage_dtypes"]}
        record(figures)
    if a.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
