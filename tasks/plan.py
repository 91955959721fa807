"""Size a run before renting GPUs: the extraction plan of a config, computed on any machine from
the verifier's config.json and tokenizer files alone (no weights, no model load, no GPU).

    prepare (tokenize the chat data: the tokenizer is all it loads) -> the extraction plan
    (tasks/extract/plan.py: tokens, bytes, shards, host memory, free disk) -> a time estimate for the
    GPU the run will get, next to the plan's own estimate for this machine.

With regeneration on, the plan counts the tokens of the answers in the data as it is; the run
extracts the verifier's own answers instead (up to `regenerate.max_new_tokens` per turn).

First of all, before tokenizing anything, it asks whether the installed vLLM can serve the verifier
with an EAGLE-3 draft (tasks/preflight.py): a run that requires live validation and could not have
it is refused at once, one that only wants it is warned.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from tasks.common.config import PipelineConfig
from tasks.common.progress import format_seconds
from tasks.common.verifier import VerifierInfo, inspect_verifier, read_config, text_config
from tasks.common.vllm_support import eagle3_support
from tasks.extract.plan import ExtractError, ExtractionPlan, check_disk, check_host_memory, make_plan
from tasks.preflight import check_live_validation
from tasks.prepare.dataset import PreparedData, load_prepared
from tasks.prepare.stage import prepare

log = logging.getLogger(__name__)

# Dense bf16 TFLOP/s of an H100 / H200 SXM; the plan assumes 40% of it, as tasks/extract/plan.py's
# estimate assumes 40% of the matmul rate it measures.
H100_BF16_TFLOPS = 989.0
UTILIZATION = 0.4


@dataclass(frozen=True)
class RunSizing:
    plan: ExtractionPlan
    prepared: PreparedData
    parameters: int
    parameters_from: str  # "weights", "safetensors index" or "config.json"
    gpu_tflops: float
    gpu_seconds: float
    problems: list[str]  # why extraction would refuse to start on this machine (disk, host memory)
    regenerate: bool
    serving: str  # whether vLLM here serves the verifier with an EAGLE-3 draft (live validation)

    def summary(self) -> dict:
        return {**self.plan.summary(), "prepared": self.prepared.path, "verifier_parameters_b": round(
            self.parameters / 1e9, 2), "parameters_from": self.parameters_from, "gpu_tflops": self.gpu_tflops,
            "estimated_time_on_gpu": format_seconds(self.gpu_seconds), "problems_here": self.problems,
            "regenerate": self.regenerate, "live_validation": self.serving}

    def describe(self) -> str:
        lines = [self.plan.describe(),
                 f"  verifier: {self.parameters / 1e9:.2f} B parameters (from {self.parameters_from}); on one GPU "
                 f"of {self.gpu_tflops:g} dense bf16 TFLOP/s at {UTILIZATION:.0%}: about "
                 f"{format_seconds(self.gpu_seconds)}",
                 f"  prepared data: {self.prepared.path}"
                 + (" (regeneration is on: these are the tokens of the data's own answers; the run extracts the "
                    "verifier's answers instead, whose lengths differ)" if self.regenerate else " (the run reuses it)"),
                 f"  live validation: {self.serving}"]
        lines += [f"  here, extraction would refuse to start: {p}" for p in self.problems] or [
            "  here: the disk and host memory checks pass"]
        return "\n".join(lines)


def parameter_count(verifier: VerifierInfo) -> tuple[int, str]:
    """The verifier's parameters: from its weight files, else the safetensors index's total size,
    else a dense decoder's count from config.json (embeddings, attention, gated MLP)."""
    if verifier.weight_bytes:
        return verifier.weight_bytes // 2, "weights"  # what tasks/extract/plan.py's estimate assumes (bf16)
    index = verifier.path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["metadata"]["total_size"] // 2, "safetensors index"
    lm, _ = text_config(read_config(verifier.path))
    h, layers, vocab = lm["hidden_size"], lm["num_hidden_layers"], lm["vocab_size"]
    heads = lm.get("num_attention_heads", 1)
    head_dim = lm.get("head_dim") or h // heads
    kv_heads = lm.get("num_key_value_heads", heads)
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    mlp = 3 * h * lm.get("intermediate_size", 4 * h)
    embeddings = vocab * h * (1 if lm.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp + 2 * h), "config.json"


def size_run(config: PipelineConfig, gpu_tflops: float = H100_BF16_TFLOPS) -> RunSizing:
    """`config` with local paths (demo:// resolved). Writes the prepared data and creates the
    hidden-state folder under output_dir, as the run would; loads no model."""
    verifier = inspect_verifier(config.verifier.path)
    serving = serving_line(config, verifier)
    parameters, source = parameter_count(verifier)
    prepared = prepare(config.verifier.path, config.data.sources, config.output_dir,
                       max_seq_len=config.data.max_seq_len, max_rows=config.data.max_rows,
                       supervise_end_of_turn=config.data.supervise_end_of_turn,
                       trust_remote_code=config.verifier.trust_remote_code)
    layers = verifier.aux_layers(config.extract.aux_layers) + [verifier.num_layers]
    out_dir = Path(config.output_dir) / "hidden_states"
    # the plan's estimate for this machine takes the parameter count from the weights' bytes
    sized = replace(verifier, weight_bytes=2 * parameters) if not verifier.weight_bytes else verifier
    plan = make_plan(load_prepared(prepared.path), sized, layers, out_dir, compute_dtype=config.verifier.dtype,
                     shard_tokens=config.extract.shard_tokens, storage_dtype=config.extract.storage_dtype)
    problems = []
    for check in (lambda: check_disk(plan, out_dir, config.extract.reserve_disk_gb),
                  lambda: check_host_memory(plan, config.extract.workers) if plan.pending else None):
        try:
            check()
        except ExtractError as e:
            problems.append(str(e))
    gpu_seconds = 2 * parameters * plan.pending_tokens / (UTILIZATION * gpu_tflops * 1e12)
    return RunSizing(plan, prepared, parameters, source, gpu_tflops, gpu_seconds, problems,
                     config.data.regenerate.enabled, serving)


def serving_line(config: PipelineConfig, verifier: VerifierInfo) -> str:
    """What live validation will do; a PreflightError when it is required and cannot run."""
    if config.validation.live == "skip":
        return "skipped (validation.live: skip)"
    skipped = check_live_validation(config)
    if skipped:
        log.warning("%s", skipped)
        return skipped
    support = eagle3_support(verifier)
    return f"vLLM {support.vllm} serves {support.model_class} with an EAGLE-3 draft"

