"""Size a run before renting GPUs, on any machine, from the verifier's config.json alone (no weights,
no model load, no GPU; deployments/verifiers/ holds such folders for the presets' verifiers).

    whether vLLM serves the verifier -> prepare (tokenize the chat data: the tokenizer is all it
    loads) -> the extraction plan (tasks/extract/plan.py: tokens, bytes, shards, host memory, free
    disk) -> a time estimate on the target GPUs: the slower of the extraction rate measured on an
    H100 (scaled by active parameters) and the writes at the disk's sustained rate; then training's
    (tasks/train/sizing.py), and both modes' wall time: offline extracts then trains, a stream
    extracts every epoch while training, at the pace of the slower

- First, before tokenizing anything, it asks whether the installed vLLM can serve the verifier with
  an EAGLE-3 draft (tasks/preflight.py): its model class, and for a multimodal wrapper whether vLLM's
  engine can build the processor from the folder's files. A run that requires live validation and
  could not have it is refused at once; for one that only wants it, the plan says validation will be
  static only, and why.
- A folder without tokenizer files is tokenized by a stand-in (the demo's SmolLM2 tokenizer under
  the folder's own chat template where it ships one); the output says which tokenizer counted.
- The tokenized data goes to a temporary folder, removed after, unless `keep` (then under
  output_dir, where the run reuses it): a plan leaves nothing behind.
- With regeneration on, the plan counts the tokens of the answers in the data as it is; the run
  extracts the verifier's own answers instead (up to `regenerate.max_new_tokens` per turn).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.common.config import PipelineConfig
from tasks.common.hub import hub_snapshot
from tasks.common.progress import format_bytes, format_seconds
from tasks.common.verifier import (
    TOKENIZER_FILES,
    VerifierError,
    VerifierInfo,
    check_tokenizer_files,
    inspect_verifier,
    read_config,
    text_config,
)
from tasks.common.vllm_support import eagle3_support
from tasks.extract.plan import (
    LAYERS_STORED,
    MEASURED_MAX_TOKENS_PER_S,
    ExtractError,
    ExtractionPlan,
    check_disk,
    check_host_memory,
    estimate_seconds,
    make_plan,
)
from tasks.extract.storage_dtype import bytes_per_token
from tasks.preflight import PreflightError, check_live_validation
from tasks.prepare.chat_data import source_name
from tasks.prepare.dataset import PreparedData, load_prepared
from tasks.prepare.stage import prepare
from tasks.train.sizing import TrainingSize, size_training

log = logging.getLogger(__name__)

# Dense bf16 TFLOP/s of an H100 / H200 SXM (the same chip's compute), what --gpu-tflops scales from.
H100_BF16_TFLOPS = 989.0
# Extraction measured on one H100 for Llama-3.1-8B shapes (8.03 B parameters), tokens/s: eager and
# with extract.compile, in fp8 shards, whose writes kept well below the disk's rate (bf16 shards: 29,555
# and 33,435, their writes near it; docs/benchmarks.json extract_vs_best_forward, 2026-12-06). The
# disk is the estimate's other term. A verifier of other shapes is estimated at the same share of the
# GPU's arithmetic, by its active parameters.
MEASURED_TOKENS_PER_S = {"eager": 30_762, "compiled": 38_126}
MEASURED_PARAMETERS = 8.03e9
# What the H200 machine's disk sustained under extraction's writes: 1.0-1.2 GB/s (SmolLM2 preset: 225,451
# tokens/s x 4,608 bytes in bf16, 431,290 x 2,304 in fp8; 8B shapes: 1.06-1.2 GB/s; docs/BENCHMARKS.md).
# A small verifier's writes outpace most disks: scaled from 8B shapes, SmolLM2 would extract ~2M
# tokens/s (no extraction was measured past MEASURED_MAX_TOKENS_PER_S); the disk bound says 217k in
# bf16, and 225,451 were measured.
MEASURED_DISK_BYTES_PER_S = 1.0e9
STAND_IN_TOKENIZER = "smollm2-135m-instruct"  # the demo's asset (tasks/common/demo_assets.py)


@dataclass(frozen=True)
class RunSizing:
    plan: ExtractionPlan
    prepared: PreparedData
    tokenizer: str  # which tokenizer counted the tokens
    parameters: int
    active_parameters: int  # per token: a mixture of experts computes only the routed ones
    parameters_from: str  # "weights", "safetensors index" or "config.json"
    gpus: int
    gpu_tflops: float
    disk_bytes_per_s: float  # the output folder's sustained write rate, all the run's writers together
    compute_seconds: float  # extraction's forward at the measured rate, the disk aside
    disk_seconds: float  # its writes at disk_bytes_per_s
    problems: list[str]  # why extraction would refuse to start on this machine (disk, host memory)
    regenerate: bool
    serving: str  # whether vLLM here serves the verifier with an EAGLE-3 draft (live validation)
    kept: bool  # the prepared data stays under output_dir
    stream_disk_bytes: int  # extract.mode 'stream': the window and the validation shards (expected count)
    training: TrainingSize
    stream_shares_gpus: bool  # cluster.executor 'local': the producers run on training's own GPUs
    cpu_seconds: float | None = None  # where this machine has no GPU: the extraction on its CPU (the demo's case)

    @property
    def gpu_seconds(self) -> float:
        return max(self.compute_seconds, self.disk_seconds)

    @property
    def bound(self) -> str:
        """What sets gpu_seconds: "compute" (the verifier's forward) or "disk" (the writes)."""
        return "disk" if self.disk_seconds > self.compute_seconds else "compute"

    @property
    def recommended_storage_dtype(self) -> str:
        """fp8_e4m3 where the disk binds bf16 shards (fp8 writes half the bytes); else the configured one."""
        return "fp8_e4m3" if self.plan.storage_dtype == "bf16" and self.bound == "disk" else self.plan.storage_dtype

    def fp8_seconds(self) -> float:
        fp8_bytes = bytes_per_token("fp8_e4m3", LAYERS_STORED, self.plan.hidden_size) / self.plan.bytes_per_token
        return max(self.compute_seconds, self.disk_seconds * fp8_bytes)

    @property
    def offline_seconds(self) -> float:
        return self.gpu_seconds + self.training.seconds

    @property
    def stream_seconds(self) -> float:
        """On GPUs of their own (Ray), the slower of training and its epochs' extraction, side by side.
        On shared GPUs (one machine), at most their sum: the two processes take turns on each GPU, and
        overlap only where training leaves it idle (measured on one H100, SmolLM2 preset: training ran
        at 0.82 of its offline rate while the producer extracted 3.2 epochs; docs/BENCHMARKS.md)."""
        passes = self.training.epochs * self.gpu_seconds
        return self.training.seconds + passes if self.stream_shares_gpus else max(self.training.seconds, passes)

    def modes(self) -> list[str]:
        """Offline and streamed side by side: disk peak, verifier passes, extraction and training time."""
        passes = self.training.epochs
        return [f"  offline: {format_bytes(self.plan.bytes_total)} of hidden states on disk, kept for later runs; the "
                f"verifier runs once, then the draft trains: about {format_seconds(self.offline_seconds)}",
                "  stream (extract.mode, with train.shuffle_block_shards): at most "
                f"{format_bytes(self.stream_disk_bytes)} on disk, nothing kept; the verifier runs once per epoch "
                f"begun ({passes}: {format_seconds(passes * self.gpu_seconds)} of extraction) while the draft trains: "
                + (f"at most {format_seconds(self.stream_seconds)} (on this machine they share the GPUs and take "
                   "turns on them)" if self.stream_shares_gpus else
                   f"about {format_seconds(self.stream_seconds)}, the pace of "
                   + ("training" if self.training.seconds >= passes * self.gpu_seconds else "extraction")
                   + " (producers and training on GPUs of their own)")
                + "; with extract.stream_cache_epochs: offline's disk and one pass, during the first epoch "
                "(docs/STREAMING.md)"]

    def summary(self) -> dict:
        plan = {k: v for k, v in self.plan.summary().items() if k not in ("estimated_time", "planned_estimate")}
        return {**plan, "prepared": self.prepared.path if self.kept else None, "tokenizer": self.tokenizer,
                "verifier_parameters_b": round(self.parameters / 1e9, 2),
                "active_parameters_b": round(self.active_parameters / 1e9, 2), "parameters_from": self.parameters_from,
                "gpus": self.gpus, "gpu_tflops": self.gpu_tflops, "disk_gb_per_s": self.disk_bytes_per_s / 1e9,
                "estimated_time_on_gpu": format_seconds(self.gpu_seconds), "bound_by": self.bound,
                "recommended_storage_dtype": self.recommended_storage_dtype,
                "problems_here": self.problems,
                "regenerate": self.regenerate, "live_validation": self.serving,
                "train_steps": self.training.steps, "train_tokens_per_s": round(self.training.tokens_per_s),
                "train_bound_by": self.training.bound, "estimated_train_time": format_seconds(self.training.seconds),
                "offline_time": format_seconds(self.offline_seconds), "stream_time": format_seconds(self.stream_seconds),
                "stream_disk_peak_gb": round(self.stream_disk_bytes / 1e9, 3),
                "stream_shares_gpus": self.stream_shares_gpus,
                "stream_verifier_passes": self.training.epochs,
                "estimated_time_here_on_cpu": format_seconds(self.cpu_seconds) if self.cpu_seconds is not None
                else None}

    def describe(self) -> str:
        plan = self.plan.describe(estimate=False)  # this machine's speed is no help: the run is elsewhere
        active = (f", {self.active_parameters / 1e9:.1f} B active per token"
                  if self.active_parameters < 0.9 * self.parameters else "")  # a mixture of experts
        lines = [plan, f"  tokens counted by {self.tokenizer}"
                       + (" (with regeneration on, these are the data's own answers; the run extracts the "
                          "verifier's answers instead, whose lengths differ)" if self.regenerate else ""),
                 f"  verifier: {self.parameters / 1e9:.2f} B parameters{active} (from {self.parameters_from}); "
                 f"extraction on the run's {self.gpus} GPU(s) of {self.gpu_tflops:g} dense bf16 TFLOP/s: about "
                 f"{format_seconds(self.gpu_seconds)}, bound by the {self.bound} (the slower of the rate measured "
                 f"for 8B shapes on an H100, scaled by active parameters up to the fastest extraction measured, "
                 f"{MEASURED_MAX_TOKENS_PER_S:,} tokens/s a GPU, and the writes at "
                 f"{self.disk_bytes_per_s / 1e9:g} GB/s; docs/BENCHMARKS.md)",
                 *([f"  on this machine, which has no GPU, the run computes on its CPU: extraction about "
                    f"{format_seconds(self.cpu_seconds)} (this CPU's matmul rate at 40%)"]
                   if self.cpu_seconds is not None else []),
                 *([f"  the disk binds bf16 shards: extract.storage_dtype: fp8_e4m3 writes half the bytes, about "
                    f"{format_seconds(self.fp8_seconds())} of extraction (8B shapes on one H100: 1.14x bf16's rate; "
                    "drafts from fp8 shards: 0.9997 of bf16's acceptance; docs/BENCHMARKS.md, docs/RESULTS.md)"]
                   if self.recommended_storage_dtype != self.plan.storage_dtype else []),
                 f"  training on {self.training.gpus} GPU(s): about {format_seconds(self.training.seconds)} in steady "
                 f"state, {self.training.describe()}; start-up and validation come on top",
                 *self.modes(),
                 f"  live validation: {self.serving}",
                 f"  prepared data: {self.prepared.path} (the run reuses it)" if self.kept else
                 "  nothing was written (--keep writes the prepared data under output_dir for the run to reuse)"]
        lines += [f"  here, extraction would refuse to start: {p}" for p in self.problems] or [
            "  here: the disk and host memory checks pass"]
        return "\n".join(lines)


def parameter_count(verifier: VerifierInfo) -> tuple[int, int, str]:
    """(parameters, active parameters per token, where the total came from): the total from the
    weight files, else the safetensors index, else config.json; the active ones from config.json
    (a mixture of experts computes its routed and shared experts only; latent attention its ranks)."""
    lm, _ = text_config(read_config(verifier.path))
    h, layers, vocab = lm["hidden_size"], lm["num_hidden_layers"], lm["vocab_size"]
    heads = lm.get("num_attention_heads", 1)
    head_dim = lm.get("head_dim") or h // heads
    if lm.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V3, Kimi-K2)
        q_head = lm["qk_nope_head_dim"] + lm["qk_rope_head_dim"]
        q = h * lm["q_lora_rank"] + lm["q_lora_rank"] * heads * q_head if lm.get("q_lora_rank") else h * heads * q_head
        kv = h * (lm["kv_lora_rank"] + lm["qk_rope_head_dim"]) + lm["kv_lora_rank"] * heads * (
            lm["qk_nope_head_dim"] + lm["v_head_dim"])
        attention = q + kv + heads * lm["v_head_dim"] * h
    else:
        kv_heads = lm.get("num_key_value_heads", heads)
        attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    dense_mlp = 3 * h * lm.get("intermediate_size", 4 * h)
    experts = lm.get("n_routed_experts") or lm.get("num_experts") or lm.get("num_local_experts") or 0
    per_token = (lm.get("num_experts_per_tok") or lm.get("experts_per_token") or 0) + (lm.get("n_shared_experts") or 0)
    expert_mlp = 3 * h * (lm.get("moe_intermediate_size") or lm.get("intermediate_size", 4 * h))
    moe_layers = layers - (lm.get("first_k_dense_replace") or 0) if experts else 0
    embeddings = vocab * h * (1 if lm.get("tie_word_embeddings") else 2)
    base = embeddings + layers * (attention + 2 * h) + (layers - moe_layers) * dense_mlp
    total = base + moe_layers * (experts + (lm.get("n_shared_experts") or 0)) * expert_mlp
    active = base + moe_layers * per_token * expert_mlp
    if verifier.weight_bytes:
        return verifier.weight_bytes // 2, min(active, verifier.weight_bytes // 2), "weights"
    index = verifier.path / "model.safetensors.index.json"
    if index.is_file():
        stored = json.loads(index.read_text())["metadata"]["total_size"] // 2
        return stored, min(active, stored), "safetensors index"
    return total, active, "config.json"


@contextmanager
def tokenizer_for(config: PipelineConfig) -> Iterator[tuple[str, str]]:
    """(a folder prepare can load a tokenizer from, what it is): the verifier's own, or where the
    folder has none, the demo's SmolLM2 tokenizer under the verifier's chat template if it ships one."""
    verifier = Path(config.verifier.path)
    try:
        check_tokenizer_files(verifier, config.verifier.trust_remote_code)
    except VerifierError as e:
        if "has no tokenizer" not in str(e):
            raise
    else:
        yield str(verifier), "the verifier's own tokenizer"
        return
    from tasks.common.demo_assets import ensure_asset

    stand_in = ensure_asset(STAND_IN_TOKENIZER)
    own_template = (verifier / "chat_template.jinja").is_file()
    with tempfile.TemporaryDirectory(prefix="eagle3-plan-tokenizer-") as folder:
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            source = verifier / name if name == "chat_template.jinja" and own_template else stand_in / name
            if source.is_file():
                shutil.copy(source, Path(folder) / name)
        yield folder, ("a stand-in, SmolLM2's tokenizer (49,152 tokens) under "
                       + ("the verifier's own chat template" if own_template else "SmolLM2's chat template")
                       + ": the verifier folder has no tokenizer files, and its own tokenizer counts otherwise")


@contextmanager
def prepared_into(config: PipelineConfig, keep: bool) -> Iterator[Path]:
    if keep:
        yield Path(config.output_dir)
        return
    with tempfile.TemporaryDirectory(prefix="eagle3-plan-") as folder:
        yield Path(folder)


def size_run(config: PipelineConfig, gpu_tflops: float = H100_BF16_TFLOPS, keep: bool = False,
             disk_bytes_per_s: float = MEASURED_DISK_BYTES_PER_S) -> RunSizing:
    """`config` with local paths (demo:// resolved); loads no model. Nothing is written under
    output_dir unless `keep`. `disk_bytes_per_s`: what the output folder sustains in writes from all
    the run's writers together (one node's disk, or a cluster's shared filesystem: docs/SCALE.md)."""
    verifier = inspect_verifier(config.verifier.path)
    serving = serving_line(config, verifier)
    parameters, active, source = parameter_count(verifier)
    if not config.data.sources:
        raise PreflightError("plan sizes a run from its data, and this one has none before it runs (data.synthesize "
                             "writes its prompts then): plan it with data.sources naming a sample of similar chats")
    if config.data.synthesize.prompts:
        log.info("the %d prompts data.synthesize writes are not counted: the plan covers data.sources",
                 config.data.synthesize.prompts)
    log.info("planning %s: tokenizing %s", config.name, ", ".join(map(source_name, config.data.sources)))
    with tokenizer_for(config) as (tokenizer_path, tokenizer), prepared_into(config, keep) as where:
        prepared = prepare(tokenizer_path, config.data.sources, where, max_seq_len=config.data.max_seq_len,
                           max_rows=config.data.max_rows, supervise_end_of_turn=config.data.supervise_end_of_turn,
                           trust_remote_code=config.verifier.trust_remote_code)
        layers = verifier.aux_layers(config.extract.aux_layers) + [verifier.num_layers]
        out_dir = Path(config.output_dir) / "hidden_states"
        if keep:
            out_dir.mkdir(parents=True, exist_ok=True)
        # the run's folder where it exists (its shards count as done); else the nearest folder above it,
        # for the free disk
        probe = out_dir if out_dir.is_dir() else next(p for p in out_dir.parents if p.is_dir())
        plan = make_plan(load_prepared(prepared.path), verifier, layers, probe, compute_dtype=config.verifier.dtype,
                         shard_tokens=config.extract.shard_tokens, storage_dtype=config.extract.storage_dtype,
                         check_existing=out_dir.is_dir(), estimate=False)
    problems = []
    for check in (lambda: check_disk(plan, out_dir, config.extract.reserve_disk_gb),
                  lambda: check_host_memory(plan, config.extract.workers) if plan.pending else None):
        try:
            check()
        except ExtractError as e:
            problems.append(str(e))
    e = config.extract
    gpus = e.gpus
    rate = min(MEASURED_TOKENS_PER_S["compiled" if e.compile else "eager"] * (MEASURED_PARAMETERS / active),
               MEASURED_MAX_TOKENS_PER_S) * (gpu_tflops / H100_BF16_TFLOPS) * gpus
    compute_s, disk_s = plan.pending_tokens / rate, plan.bytes_to_write / disk_bytes_per_s
    shard_bytes = max(s.tokens for s in plan.shards) * plan.bytes_per_token
    val_shards = math.ceil(config.train.val_fraction * len(plan.shards))  # held out whole in block order
    shape, _ = text_config(read_config(verifier.path))
    training = size_training(shape, config.train, min(config.vocab.draft_vocab_size, shape["vocab_size"]),
                             plan.tokens, gpu_tflops, H100_BF16_TFLOPS)
    return RunSizing(plan, prepared, tokenizer, parameters, active, source, gpus, gpu_tflops, disk_bytes_per_s,
                     compute_s, disk_s, problems,
                     config.data.regenerate.enabled, serving, keep,
                     min(len(plan.shards), e.stream_window + val_shards) * shard_bytes, training,
                     config.cluster.executor == "local",
                     None if torch.cuda.is_available() else
                     estimate_seconds(verifier, plan.pending_tokens, config.verifier.dtype))


def serving_line(config: PipelineConfig, verifier: VerifierInfo) -> str:
    """What live validation will do, from the model class and what vLLM's engine loads for it at start (a
    multimodal wrapper's processor files); a PreflightError when it is required and cannot run."""
    if config.validation.live == "skip":
        return "skipped (validation.live: skip)"
    # a folder without weights that is no Hub snapshot is a config-only one (deployments/verifiers/): the run
    # uses another, and the files vLLM's engine loads from that one cannot be checked here
    config_only = not verifier.weight_files and hub_snapshot(verifier.path) is None
    skipped = check_live_validation(config, engine_files=not config_only)
    if skipped:
        log.warning("%s", skipped)
        return skipped
    support = eagle3_support(verifier)
    line = f"vLLM {support.vllm} serves {support.model_class} with an EAGLE-3 draft"
    if support.multimodal and config_only:
        line += (f"; its engine also builds this multimodal model's processor at start, from the run's verifier "
                 f"folder (its processor and tokenizer files): {verifier.path} holds no weights, so its own files "
                 "were not checked")
    return line
