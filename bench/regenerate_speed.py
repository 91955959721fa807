"""Answer regeneration with transformers: generated tokens/s of four ways to run the same greedy
generation of ShareGPT first turns, side by side in one process.

    python bench/regenerate_speed.py --verifier DIR --data sharegpt.json [--prompts 2048 --max-new-tokens 512]

- `dynamic`: what the pipeline did before: batches of --dynamic-rows prompts in file order, left
  padded, transformers' default (dynamic) KV cache, no compilation; run on the first
  --dynamic-prompts prompts only (it is slow).
- `static`: the pipeline's `TransformersGenerator` (length-sorted fixed-shape batches over static
  KV caches of a few sizes, the decoding step compiled once per size with CUDA graphs, attention
  reading each KV head once: tasks/prepare/decode_attention.py).
- `static-sdpa`: the same with transformers' own SDPA attention (with a padding mask it copies the
  KV heads for every query head at every step): what the folded attention saves.
- `continuous`: transformers' continuous batching (`generate_batch`: paged KV cache, finished
  rows refilled at once), with its default configuration.

For each: the warm-up (compilation, CUDA graph capture; for `static`, one batch per KV cache size
the prompts need, so every compiled step exists) is timed apart from the steady state. Greedy outputs are compared with `dynamic` on the prompts both ran (bf16 batched
generation flips near-ties, so a few differ). Prints one JSON line; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.common.config import RegenerateSettings  # noqa: E402
from tasks.prepare.chat_data import Dropped, normalize, read_rows  # noqa: E402
from tasks.prepare.generators import TransformersGenerator  # noqa: E402


def first_turn_prompts(tokenizer, data: str, limit: int, max_prompt_len: int) -> list[list[int]]:
    prompts = []
    for row in read_rows([data]):
        messages = row.data if isinstance(row.data, Dropped) else normalize(row.data)
        if isinstance(messages, Dropped):
            continue
        answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), 0)
        if not answer:
            continue
        ids = tokenizer.apply_chat_template(messages[:answer], add_generation_prompt=True, tokenize=True)["input_ids"]
        if len(ids) < max_prompt_len:
            prompts.append(ids)
        if len(prompts) == limit:
            break
    return prompts


def timed(generate, warm_up: list[list[list[int]]], prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The warm-up calls (compilation, CUDA graph capture) timed apart from the steady-state call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    first = [answer for call in warm_up for answer in generate(call)]
    sync()
    t1 = time.perf_counter()
    rest = generate(prompts)
    sync()
    t2 = time.perf_counter()
    generated = sum(map(len, first)) + sum(map(len, rest))
    return {"prompts": len(prompts), "warm_up_prompts": sum(map(len, warm_up)), "generated_tokens": generated,
            "first_call_s": round(t1 - t0, 1), "steady_s": round(t2 - t1, 1),
            "steady_tokens_per_s": round(sum(map(len, rest)) / (t2 - t1)) if rest else None,
            "wall_tokens_per_s": round(generated / (t2 - t0)),
            "answers_at_the_cap": sum(len(o) >= max_new_tokens for o in rest), "outputs": rest}


def one_prompt_per_cache_size(generator: TransformersGenerator, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Warm-up calls of one prompt each (a batch filled up with it), one per KV cache size the
    prompts need: every compiled decoding step exists before the steady state is timed."""
    by_size: dict[int, list[int]] = {}
    for prompt in prompts:
        by_size.setdefault(generator.cache_positions(len(prompt)), prompt)
    return [[prompt] for prompt in by_size.values()]


def dynamic_generator(model, pad: int, rows: int, max_new_tokens: int):
    def generate(prompts):
        out = []
        for start in range(0, len(prompts), rows):
            batch = prompts[start: start + rows]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, do_sample=False,
                                     max_new_tokens=max_new_tokens, disable_compile=True)
            out += [[t for t in row if t != pad] for row in gen[:, width:].tolist()]
        return out
    return generate


def continuous_generator(model, pad: int, eos: int, max_new_tokens: int):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)

    def generate(prompts):
        results = model.generate_batch(prompts, generation_config=config, persistent_manager=True)
        outputs = list(results.values())
        if len(outputs) != len(prompts) or any(o.error for o in outputs):
            raise RuntimeError(f"continuous batching returned {len(outputs)} of {len(prompts)} results")
        return [[t for t in o.generated_tokens if t != pad] for o in outputs]
    return generate


def identical_share(reference: dict[int, list[int]], other: dict[int, list[int]]) -> float:
    """Share of identical answers over the prompts (by index) both timed."""
    pairs = [(reference[i], other[i]) for i in reference.keys() & other.keys()]
    return round(sum(a == b for a, b in pairs) / len(pairs), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--prompts", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--dynamic-prompts", type=int, default=512)
    p.add_argument("--dynamic-rows", type=int, default=512)
    p.add_argument("--rows", type=int, help="rows per batch of the static variants (default: what fits)")
    p.add_argument("--variants", default="dynamic,static,static-sdpa,continuous")
    p.add_argument("--out")
    a = p.parse_args()
    n = a.max_new_tokens
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.verifier)
    prompts = first_turn_prompts(tokenizer, a.data, a.prompts, a.max_prompt_len)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "max_new_tokens": n,
                     "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1)}
    for variant in a.variants.split(","):
        t0 = time.perf_counter()
        if variant in ("static", "static-sdpa"):
            settings = RegenerateSettings(max_new_tokens=n, batch_size=a.rows)
            attention = "sdpa" if variant == "static-sdpa" else "sdpa_folded_gqa"
            generator = TransformersGenerator(a.verifier, tokenizer, settings, a.max_prompt_len, False, attention)
            generate, extra = generator, {"rows": generator.rows}
            warm_up = one_prompt_per_cache_size(generator, prompts)
            subset = prompts
        else:
            model = AutoModelForCausalLM.from_pretrained(a.verifier, dtype=torch.bfloat16).to(device).eval()
            if variant == "dynamic":  # the first batch warms up; the rest is timed
                generate, extra = dynamic_generator(model, pad, a.dynamic_rows, n), {}
                subset = prompts[: a.dynamic_prompts]
                warm_up, subset = [subset[: a.dynamic_rows]], subset[a.dynamic_rows:]
            else:
                generate, extra = continuous_generator(model, pad, tokenizer.eos_token_id, n), {}
                warm_up, subset = [prompts[:64]], prompts[64:]
        load_s = time.perf_counter() - t0
        try:
            results[variant] = {"load_s": round(load_s, 1), **extra, **timed(generate, warm_up, subset, n)}
            first = len(prompts) - len(subset) if variant != "dynamic" else a.dynamic_rows  # subset's first index
            results[variant]["outputs"] = dict(enumerate(results[variant]["outputs"], start=first))
        except Exception as e:  # one variant failing must not lose the others' numbers
            results[variant] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(variant, {k: v for k, v in results[variant].items() if k != "outputs"}, flush=True)
        del generate
        torch.cuda.empty_cache() if device == "cuda" else None
    reference = results.get("dynamic", {}).get("outputs")
    for variant in ("static", "static-sdpa", "continuous"):
        if reference and "outputs" in results.get(variant, {}):
            results[variant]["identical_to_dynamic"] = identical_share(reference, results[variant]["outputs"])
    variants = ("dynamic", "static", "static-sdpa", "continuous")
    rates = {v: results[v]["steady_tokens_per_s"] for v in variants
             if results.get(v, {}).get("steady_tokens_per_s")}
    results["regenerate_tokens_per_s"] = rates.get("static")
    if "dynamic" in rates:
        results.update({f"{v}_vs_dynamic": round(r / rates["dynamic"], 2) for v, r in rates.items() if v != "dynamic"})
    for v in variants:
        results.get(v, {}).pop("outputs", None)
    line = json.dumps(results)
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
