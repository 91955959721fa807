"""Checks before the flow's first task: everything that can be known without loading a model.

A run that would fail on a missing folder, an unreadable file, an empty data source, an
unwritable output folder or auxiliary layers outside the verifier's depth fails here, in a
second, with one message naming the problem, instead of minutes later in a stage (and its
retries). So does a run whose draft vLLM could not serve for live validation when that is
required (where it is only wanted, the run goes on with a warning and validation runs its static checks
only): its model class, and for a multimodal wrapper the processor files vLLM's engine loads at start.
Takes a config whose `demo://` paths are resolved (tasks/common/demo_assets.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.hub import hub_snapshot
from tasks.common.progress import format_bytes
from tasks.common.verifier import TOKENIZER_FILES, check_tokenizer_files, inspect_verifier, read_config, text_config
from tasks.common.vllm_support import EXTRACTION_ADVICE, serving_problem
from tasks.prepare.chat_data import (
    DATA_SUFFIXES,
    DataSourceError,
    Dropped,
    data_source,
    dataset_columns,
    is_dataset_folder,
    read_conversation,
    read_rows,
    source_files,
)

log = logging.getLogger(__name__)


class PreflightError(PermanentError, ValueError):
    """The run cannot succeed as configured; the message names the setting and the path."""


def check_readable(path: Path, what: str) -> None:
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise PreflightError(f"{what} {path} cannot be read: {e.strerror or e}") from None


def check_verifier(config) -> None:
    verifier = inspect_verifier(config.verifier.path)  # VerifierError: missing folder, config.json, sizes
    verifier.aux_layers(config.extract.aux_layers)  # VerifierError: layers outside its depth
    if not verifier.weight_files:
        snapshot = hub_snapshot(verifier.path)  # offline, with only what `plan` fetched in the cache
        advice = (f": download them with `hf download {snapshot.repo_id} --revision {snapshot.commit}`" if snapshot
                  else "")
        raise PreflightError(f"verifier.path {verifier.path} holds no weight files (*.safetensors, *.bin, *.gguf)"
                             + advice)
    for name in ("config.json", *verifier.weight_files, *(n for n in TOKENIZER_FILES if (verifier.path / n).exists())):
        check_readable(verifier.path / name, "verifier file")
    check_tokenizer_files(verifier.path, config.verifier.trust_remote_code)


def is_blank(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(1 << 16)
    return not head.strip() and path.stat().st_size <= len(head)


def check_data(config) -> None:
    """Every source exists and is readable, a file named in the config is not empty, what `datasets`
    reads has the split, subset and columns the config names, and some source holds data (a drop
    folder may be empty until data arrives, if another source has some)."""
    has_data = False
    for source in map(data_source, config.data.sources):
        try:
            files = source_files(source)
        except FileNotFoundError as e:
            raise PreflightError(f"data.sources: {e}") from None
        if (source.subset or source.split != "train") and not (len(files) == 1 and is_dataset_folder(files[0])):
            raise PreflightError(f"data.sources: {source.dataset}: subset and split pick a part of a Hub dataset or "
                                 "a `datasets` folder, and this is neither")
        for path in files:
            if not path.is_dir():
                check_readable(path, "data file")
                if is_blank(path):
                    if path == Path(source.dataset):
                        raise PreflightError(f"data.sources: {path} is empty")
                    continue
            has_data = True
            try:
                columns = dataset_columns(path, source)  # None for JSON, whose rows have no fixed columns
            except DataSourceError as e:
                raise PreflightError(f"data.sources: {e}") from None
            named = [c for c in (source.messages, source.prompt, source.response) if c]
            if columns is not None and (missing := [c for c in named if c not in columns]):
                raise PreflightError(f"data.sources: {path} has no column {', '.join(missing)} (its columns: "
                                     f"{', '.join(columns)})")
    if not has_data and not config.data.synthesize.prompts:  # with none, the verifier's own prompts are the data
        raise PreflightError(f"data.sources {config.data.sources} hold no data (no non-empty "
                             f"{', '.join(DATA_SUFFIXES)} file)")
    if not config.data.synthesize.prompts:
        check_rows(config)


SMALL_DATA_BYTES = 64 * 2**20  # sources this small are read here, in seconds: what could they hold that prepare keeps
ROW_CHECK_BUDGET_S = 3.0


def check_rows(config) -> None:
    """Small local sources read row by row before any stage: data with no usable conversation (garbage,
    system turns alone) fails here, with the counts by reason, not after the flow's start. Larger data, Hub
    datasets, or a read past the time budget are left to prepare (which drops and counts the same rows)."""
    files = [f for source in map(data_source, config.data.sources) for f in source_files(source)]
    if any(hub_snapshot(f) or f.is_dir() for f in files) or sum(f.stat().st_size for f in files) > SMALL_DATA_BYTES:
        return
    dropped: Counter[str] = Counter()
    deadline = time.monotonic() + ROW_CHECK_BUDGET_S
    for row in read_rows(config.data.sources, config.data.max_rows):
        conversation = row.data if isinstance(row.data, Dropped) else read_conversation(
            row.data, prompt_only_ok=config.data.regenerate.enabled)
        if not isinstance(conversation, Dropped):
            return  # one usable row: prepare decides the rest
        dropped[conversation.reason] += 1
        if time.monotonic() > deadline:
            return
    raise PreflightError(f"data.sources hold no usable conversation: {sum(dropped.values())} rows read, dropped "
                         f"{dict(dropped)}")


def check_writable(folder: Path, what: str) -> None:
    """`folder` can be created and written, tested in its nearest existing ancestor (nothing is
    left behind: a run that fails a later check has not created its output folder)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise PreflightError(f"{what} {folder}: {existing} is a file, not a folder")
    try:
        Path(tempfile.mkdtemp(prefix=".eagle3-write-test-", dir=existing)).rmdir()
    except OSError as e:
        raise PreflightError(f"{what} {folder} is not writable: {e.strerror or e} ({existing})") from None


def check_live_validation(config, engine_files: bool = True) -> str | None:
    """Whether vLLM here can serve the verifier with an EAGLE-3 draft, as validation.live asks (its
    model class, and with `engine_files` a multimodal wrapper's processor files: tasks/common/vllm_support.py
    `serving_problem`): raises when it is required and cannot; returns the reason validation will be
    static only when live validation is only wanted (`auto`), None when it will run or is not asked for."""
    if config.validation.live == "skip":
        return None
    problem = serving_problem(inspect_verifier(config.verifier.path), config.verifier.trust_remote_code,
                              engine_files)
    if problem is None:
        return None
    if config.validation.live == "required":
        raise PreflightError(f"validation.live: required, but {problem}; set validation.live: auto to "
                             "train anyway and validate statically, or skip")
    return f"{problem}: validation will run the static checks only (validation.live: auto)"


def check_vllm_extraction(config) -> None:
    """extract.backend: vllm needs a vLLM that serves the verifier with EAGLE-3 drafts (and starts its engine)."""
    if config.extract.backend != "vllm":
        return
    problem = serving_problem(inspect_verifier(config.verifier.path), config.verifier.trust_remote_code)
    if problem:
        raise PreflightError(f"extract.backend: vllm, but {problem}; {EXTRACTION_ADVICE}")


def check_before_run(config) -> None:
    """Every check; raises the first problem found (PreflightError or VerifierError)."""
    check_verifier(config)
    check_data(config)
    check_vllm_extraction(config)
    if skipped := check_live_validation(config):
        log.warning("%s", skipped)
    v = config.validation
    if v.live != "skip" and v.prompts and not Path(v.prompts).is_file():
        raise PreflightError(f"validation.prompts {v.prompts} is not a file")
    if v.baseline_draft and not (Path(v.baseline_draft) / "config.json").is_file():
        raise PreflightError(f"validation.baseline_draft {v.baseline_draft} is not a draft folder (no config.json)")
    check_writable(Path(config.output_dir).resolve(), "output_dir")
    check_training_disk(config)
    check_warm_start_draft(config)
    # top-level names only: finding `ray.train` would import Ray, before a Ray of the run's own is
    # told to stay on the loopback interface (flows/ray_stages.py, read when Ray is imported)
    if config.cluster.executor == "ray" and not all(importlib.util.find_spec(m) for m in ("ray", "prefect_ray")):
        raise PreflightError("cluster.executor 'ray' needs prefect-ray and Ray Train: pip install -e '.[ray]' "
                             "(make install does)")
    if os.environ.get("PREFECT_HOME"):
        check_writable(Path(os.environ["PREFECT_HOME"]), "PREFECT_HOME")


def check_warm_start_draft(config) -> None:
    """`train.init_from`: a draft of another verifier, hidden size, vocabulary, layers or shape is refused
    before any work (tasks/train/warm_start.py), as is a folder that is no draft."""
    from tasks.registry.parent import warm_start_source
    from tasks.train.warm_start import check_warm_start

    draft, manifest = warm_start_source(config.train.init_from, config.registry_path)
    if draft is None:
        return
    verifier = inspect_verifier(config.verifier.path)
    check_warm_start(draft, config.verifier.path, verifier.aux_layers(config.extract.aux_layers), verifier.hidden_size,
                     verifier.vocab_size, config.train, manifest)


# ---------------------------------------------------------------------------------- training's disk


@dataclass(frozen=True)
class TrainingDisk:
    """What training writes, sized from the verifier's config.json (no model loads)."""

    parameters: int  # the draft's, as a checkpoint saves them (the frozen embeddings and head included)
    trained: int  # those the optimizer trains (AdamW keeps two moments of each)
    checkpoint_bytes: int  # one checkpoint: the weights in float32, the optimizer's state
    draft_bytes: int  # the exported draft, bf16
    checkpoints_at_once: int  # train.keep_checkpoints recent ones, the best, and the next while it is written

    @property
    def needed_bytes(self) -> int:
        """The most training holds at once: its checkpoints while the next is written (the draft is written
        after the last one is, when one fewer is left, and is smaller than a checkpoint)."""
        return self.checkpoints_at_once * self.checkpoint_bytes

    def describe(self) -> str:
        return (f"{format_bytes(self.needed_bytes)}: {self.checkpoints_at_once} checkpoints of "
                f"{format_bytes(self.checkpoint_bytes)} (train.keep_checkpoints {self.checkpoints_at_once - 2} "
                f"recent ones, the best, and the next while it is written; each the draft's {self.parameters:,} "
                f"parameters in float32 and AdamW's two moments of the {self.trained:,} it trains), then the "
                f"{format_bytes(self.draft_bytes)} bf16 draft")


def training_disk(config) -> TrainingDisk:
    """The draft speculators builds for this verifier (tasks/train/model.py), counted from its config: the
    first decoder layer reads [embedding, hidden] (2x hidden wide), later ones the hidden state; a dense
    MLP as wide as the verifier's (3x hidden for an MoE verifier, as speculators does); the embeddings
    and the head over the draft vocabulary come from the verifier and stay frozen."""
    lm, _ = text_config(read_config(Path(config.verifier.path)))
    h, vocab = lm["hidden_size"], lm["vocab_size"]
    draft_vocab = min(config.vocab.draft_vocab_size, vocab)
    heads = lm.get("num_attention_heads") or 1
    kv_heads = lm.get("num_key_value_heads") or heads
    head_dim = lm.get("head_dim") or h // heads
    ffn = lm.get("intermediate_size") if isinstance(lm.get("intermediate_size"), int) else 3 * h
    t = config.train

    def layer(inputs: int) -> int:  # q, k, v; o; gate, up, down; its two norms
        return inputs * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * ffn + 2 * h

    aux = 3
    trained = (aux * h * h + layer(2 * h) + h + (t.num_layers - 1) * layer(h) + h  # fc, layers (+ hidden_norm), norm
               + aux * h * (t.fc_norm + t.norm_before_fc))
    parameters = trained + vocab * h + draft_vocab * h  # + the frozen embeddings and head
    mappings = 8 * draft_vocab + vocab  # d2t int64, t2d bool
    return TrainingDisk(parameters=parameters, trained=trained,
                        checkpoint_bytes=4 * parameters + 8 * trained + mappings, draft_bytes=2 * parameters + mappings,
                        checkpoints_at_once=t.keep_checkpoints + 2)


def training_bytes_on_disk(output_dir: Path) -> int:
    """The most one training folder of `output_dir` holds in checkpoints and draft. A run that resumes
    or trains again in its own folder writes into that space (each checkpoint replaces an older one); which
    folder is this config's is known only once its data is prepared, so the largest counts."""
    def held(folder: Path) -> int:
        files = [*(folder / "checkpoints").rglob("*"), *(folder / "draft").glob("*")]
        return sum(f.stat().st_size for f in files if f.is_file())

    return max((held(folder) for folder in (output_dir / "train").glob("*") if folder.is_dir()), default=0)


def check_training_disk(config, free_bytes: int | None = None) -> TrainingDisk:
    """Refuse a run whose output folder's disk cannot hold training's checkpoints (`free_bytes`: what is free
    there, measured unless given); the extraction's shards are checked by its own plan, before it writes."""
    output_dir = Path(config.output_dir).resolve()
    need = training_disk(config)
    if free_bytes is None:
        existing = output_dir
        while not existing.exists():
            existing = existing.parent
        free_bytes = shutil.disk_usage(existing).free
    held = training_bytes_on_disk(output_dir)
    if free_bytes + held < need.needed_bytes:
        held_text = f", and a training folder there holds {format_bytes(held)} a resume writes over" if held else ""
        raise PreflightError(f"output_dir {output_dir}: training needs {need.describe()}; "
                             f"{format_bytes(free_bytes)} is free on that disk{held_text}. Free space there, "
                             "lower train.keep_checkpoints, or point output_dir at a larger disk")
    return need

