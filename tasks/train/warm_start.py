"""Warm start (`train.init_from`): training starts from a trained draft, with replay.

- `check_warm_start` refuses, before any work, a draft that cannot be trained on from here: an
  unreadable folder, a draft of another verifier (speculators' config records the verifier's
  architectures), another hidden size, verifier vocabulary or auxiliary layers, or draft settings
  that give other weights (layers, fusion and output norms). The stage checks it with its inputs
  (tasks/train/data.py check_inputs) and the preflight before the flow starts.
- The draft keeps its vocabulary: its d2t/t2d replace the vocab stage's (its lm_head rows mean
  those tokens) and its weights (fc, layers, norms, lm_head) are loaded at step 0; the token
  embeddings are the verifier's, as the draft builds them. A resume from a checkpoint of the
  same run starts from the checkpoint instead.
- Replay: the training set is every sample the parent did not train on plus `replay_fraction` of
  those it did, chosen by content key and seed (`replay_choice`). Which samples the parent trained
  on: the samples of its extraction manifest (`parent_sample_keys`).
- Its fingerprint covers the draft's bytes (`draft_fingerprint`), not its path, and the parent's
  samples (`manifest_samples_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from tasks.common.content import sample_key
from tasks.common.errors import PermanentError
from tasks.common.sealed import file_digest
from tasks.common.verifier import inspect_verifier

if TYPE_CHECKING:
    import torch

# torch, safetensors' torch side and the shard reader load where they are used: the preflight checks a
# warm start (check_warm_start) without loading torch

DRAFT_FILES = ("config.json", "model.safetensors")
# TrainSettings fields that decide which weights the draft has or what they mean: a warm start keeps the
# parent's, so the run's must match them (the draft's config.json records each under the same name)
WEIGHT_SETTINGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# speculators' embeddings are the verifier's (loaded when the draft is built), never the parent's copy
VERIFIER_WEIGHTS = ("embed_tokens.",)


class WarmStartError(PermanentError, ValueError):
    """The draft `train.init_from` names cannot be trained on from here; the message names the difference."""


def read_draft_config(draft_dir: str | Path) -> dict:
    """The draft's config.json, with its weights file present and readable; a WarmStartError otherwise."""
    draft = Path(draft_dir)
    where = f"init_from {draft}"
    if not draft.is_dir():
        raise WarmStartError(f"{where}: no such folder (a draft folder holds {' and '.join(DRAFT_FILES)})")
    missing = [name for name in DRAFT_FILES if not (draft / name).is_file()]
    if missing:
        raise WarmStartError(f"{where}: not a draft folder, it lacks {', '.join(missing)}")
    try:
        config = json.loads((draft / "config.json").read_text())
        layer, verifier = config["transformer_layer_config"], config["speculators_config"]["verifier"]
        if config.get("speculators_model_type") != "eagle3":
            raise ValueError(f"speculators_model_type {config.get('speculators_model_type')!r}, not 'eagle3'")
        sizes = {"hidden_size": layer["hidden_size"], "vocab_size": layer["vocab_size"],
                 "draft_vocab_size": config["draft_vocab_size"]}
        not_int = [name for name, size in sizes.items() if not isinstance(size, int)]
        if not_int or not isinstance(verifier, dict):
            raise ValueError(f"{', '.join(not_int) or 'the verifier record'} malformed")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise WarmStartError(f"{where}: config.json is not a speculators EAGLE-3 draft's ({type(e).__name__}: "
                             f"{e})") from None
    try:
        names = safetensors_names(draft / "model.safetensors")
    except (OSError, UnicodeDecodeError, ValueError, struct.error) as e:  # a truncated or foreign file
        raise WarmStartError(f"{where}: model.safetensors cannot be read ({type(e).__name__}: {e})") from None
    if "fc.weight" not in names or "lm_head.weight" not in names:
        raise WarmStartError(f"{where}: model.safetensors holds no EAGLE-3 draft (no fc.weight or lm_head.weight)")
    return config


def safetensors_names(path: Path) -> set[str]:
    """The tensor names a safetensors file's header lists (its first 8 bytes: the header's length)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > path.stat().st_size:
            raise ValueError(f"a header of {length} bytes in a file of {path.stat().st_size}")
        header = json.loads(f.read(length))
    return {name for name in header if name != "__metadata__"}


def check_warm_start(draft_dir: str | Path, verifier_path: str | Path, aux_layers: list[int], hidden_size: int,
                     vocab_size: int, settings=None, parent_manifest: str | Path | None = None) -> dict:
    """Refuse a draft the run cannot start from, with one line naming the difference; returns its
    config. `settings` (TrainSettings, optional): the run's draft settings, checked against the
    draft's own. `parent_manifest` (optional): the extraction manifest the draft trained on, read."""
    where = f"init_from {Path(draft_dir)}"
    config = read_draft_config(draft_dir)
    layer, recorded = config["transformer_layer_config"], config["speculators_config"]["verifier"]
    architecture = inspect_verifier(verifier_path).architecture
    if recorded.get("architectures") and architecture not in recorded["architectures"]:
        raise WarmStartError(f"{where}: a draft of another verifier ({', '.join(recorded['architectures'])}, "
                             f"{recorded.get('name_or_path')}), the verifier {verifier_path} is a {architecture}")
    if layer["hidden_size"] != hidden_size:
        raise WarmStartError(f"{where}: hidden size {layer['hidden_size']}, the verifier's is {hidden_size}")
    if layer["vocab_size"] != vocab_size:
        raise WarmStartError(f"{where}: a verifier vocabulary of {layer['vocab_size']} tokens, the verifier's has "
                             f"{vocab_size}")
    if config.get("eagle_aux_hidden_state_layer_ids") != list(aux_layers):
        raise WarmStartError(f"{where}: auxiliary layers {config.get('eagle_aux_hidden_state_layer_ids')}, this "
                             f"run's are {list(aux_layers)}")
    if settings is not None:
        if layer.get("num_hidden_layers") != settings.num_layers:
            raise WarmStartError(f"{where}: {layer.get('num_hidden_layers')} decoder layer(s), train.num_layers is "
                                 f"{settings.num_layers}")
        for name in WEIGHT_SETTINGS:
            if bool(config.get(name, False)) != getattr(settings, name):
                raise WarmStartError(f"{where}: {name} {str(bool(config.get(name))).lower()}, train.{name} is "
                                     f"{str(getattr(settings, name)).lower()} (a warm start keeps the draft's)")
    if parent_manifest is not None:
        from tasks.extract.shards import ShardError, read_manifest

        try:
            read_manifest(parent_manifest)
        except ShardError as e:
            raise WarmStartError(f"{where}: its parent manifest cannot be read: {e}") from None
    return config


def draft_vocab(draft_dir: str | Path, vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The draft's own (d2t, t2d, draft vocabulary size); (None, None, vocab_size) for a draft of the
    verifier's full vocabulary (speculators' convention: no mapping)."""
    from safetensors import safe_open

    config = read_draft_config(draft_dir)
    size = config["draft_vocab_size"]
    with safe_open(str(Path(draft_dir) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        if size == vocab_size and "d2t" not in names:
            return None, None, vocab_size
        if not {"d2t", "t2d"} <= names:
            raise WarmStartError(f"init_from {draft_dir}: a draft vocabulary of {size} tokens without its d2t/t2d")
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    if d2t.numel() != size or t2d.numel() != vocab_size or int(t2d.sum()) != size:
        raise WarmStartError(f"init_from {draft_dir}: d2t of {d2t.numel()} and t2d of {t2d.numel()} entries "
                             f"({int(t2d.sum())} set) do not fit a draft vocabulary of {size} over {vocab_size}")
    return d2t, t2d, size


def load_parent_weights(model, draft_dir: str | Path) -> None:
    """The draft's weights into `model` (built with its vocabulary); the token embeddings stay the verifier's."""
    from tasks.train.checkpoints import load_weights

    weights = {name: w for name, w in load_weights(Path(draft_dir) / "model.safetensors").items()
               if not name.startswith(VERIFIER_WEIGHTS)}
    own = {name: p for name, p in model.state_dict().items()
           if not name.startswith(VERIFIER_WEIGHTS) and not name.startswith("verifier_")}
    differ = sorted(set(own) ^ set(weights)) or [n for n in own if own[n].shape != weights[n].shape]
    if differ:
        name = differ[0]
        shapes = [tuple(t[name].shape) if name in t else "none" for t in (weights, own)]
        raise WarmStartError(f"init_from {draft_dir}: {name} is {shapes[0]} in the draft, {shapes[1]} in the one "
                             f"this run builds ({len(differ)} tensor(s) differ)")
    model.load_state_dict(weights, strict=False)  # cast to the model's dtype


def draft_fingerprint(draft_dir: str | Path) -> str:
    """The draft's content: its weights' and config's checksums (not its path)."""
    draft = Path(draft_dir)
    read_draft_config(draft)
    parts = {name: file_digest(draft / name) for name in DRAFT_FILES}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def manifest_samples_fingerprint(manifest_path: str | Path) -> str:
    """Which samples a manifest holds: its shards' fingerprints (each covers its samples' ids and tokens)
    and which of a shard's samples it reads (`positions`, where not all), whatever else the file records."""
    from tasks.extract.shards import read_manifest

    shards = sorted(((shard["fingerprint"], shard.get("positions")) for shard in read_manifest(manifest_path)["shards"]),
                    key=lambda shard: shard[0])
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()


def parent_sample_keys(manifest_path: str | Path) -> set[str]:
    """The content keys of a manifest's samples: listed in its shard entries (`sample_keys`), else read
    from its shards' token ids (only the ids: the hidden states are never read; a manifest from before
    content keys)."""
    from safetensors import SafetensorError, safe_open

    from tasks.extract.shards import read_manifest

    manifest_path = Path(manifest_path)
    keys: set[str] = set()
    for shard in read_manifest(manifest_path)["shards"]:
        if shard.get("sample_keys") is not None:
            keys.update(shard["sample_keys"])
            continue
        path = manifest_path.parent / shard["name"]
        try:
            with safe_open(str(path), "pt") as f:
                ids, offsets = f.get_tensor("input_ids"), f.get_tensor("offsets").tolist()
        except (OSError, SafetensorError) as e:  # a missing, truncated or foreign file
            raise WarmStartError(f"the parent's samples cannot be read: {manifest_path.name} lists no sample keys "
                                 f"and its shard {path} cannot be read ({e})") from None
        # the samples the manifest reads from the shard (`positions`: some of them, in its own order)
        for i in shard.get("positions", range(len(shard["sample_ids"]))):
            keys.add(sample_key(ids[offsets[i]: offsets[i + 1]].numpy()))
    return keys


def replay_choice(train_indices: list[int], keys: list[str], parent_keys: set[str], fraction: float,
                  seed: int) -> tuple[list[int], int, int]:
    """(the training samples, how many are new, how many replayed): every sample of `train_indices`
    whose key is not in `parent_keys`, and `fraction` of those whose key is, chosen by a hash of the
    seed and the key (the same samples wherever they fall in the data)."""
    new = [i for i in train_indices if keys[i] not in parent_keys]
    seen = [i for i in train_indices if keys[i] in parent_keys]
    ranked = sorted(seen, key=lambda i: (xxhash.xxh64_intdigest(f"replay {seed} {keys[i]}".encode()), i))
    replayed = ranked[:round(fraction * len(seen))]
    return sorted(new + replayed), len(new), len(replayed)
