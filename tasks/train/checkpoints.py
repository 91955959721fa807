"""Training checkpoints: save, find, resume from, export the draft, load a saved draft.

A checkpoint holds the draft (speculators' `save_pretrained`, float32 for exact resume) and the
training state (optimizers, schedulers, step, best, RNG states, the metrics window), written to
`checkpoints/.tmp-step-<n>` and sealed (tasks/common/sealed.py): fsynced, a COMPLETE marker with
every file's checksum, then renamed. A folder without COMPLETE is never used. A resume starts from
the newest checkpoint whose files match their checksums and load; a damaged one (cut short,
changed, unreadable) is skipped with a warning naming the file, and the one before it is used.
The state holds only tensors and plain values and is read with `torch.load(weights_only=True)`, so
a `training_state.pt` swapped into the folder cannot run code on load: it is refused as damaged.
"""

from __future__ import annotations

import copy
import logging
import pickle
import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from tasks.common.journal import write_error
from tasks.common.sealed import damage, seal

log = logging.getLogger(__name__)


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder without COMPLETE is never used)."""
    return sorted(p for p in (out_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").is_file())


def newest_checkpoint_step(out_dir: Path) -> int:
    """The step of the newest checkpoint folder, read from its name (0 without one): where a resume
    most likely starts, known before anything is loaded."""
    folders = checkpoint_dirs(out_dir)
    return int(folders[-1].name.removeprefix("step-")) if folders else 0


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from; the message names the file and why."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's file is cut short, changed or unreadable: the one before it is used instead."""


def quiet_save_pretrained(model, folder: Path) -> None:
    """speculators' save_pretrained without transformers' "Writing model shards" bar, which would
    print at every checkpoint for one small shard written in well under a second."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(folder, safe_serialization=True)


@contextmanager
def writing(what: Path, tmp: Path, needed: str = ""):
    """A failed write (a full disk, a quota, an I/O error; safetensors reports its own as
    SafetensorError) as a DiskWriteError naming `what`, the disk's free space and what is `needed`;
    the temporary folder removed, so that the space it held is free again."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "file write failed" not in str(e):  # torch.save's own wording
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(f"writing {what}", what.parent, e if isinstance(e, OSError) else OSError(str(e)),
                          needed) from e


def saved_bytes(model, optimizers=()) -> int:
    """What `save_pretrained` writes of the model (speculators leaves the verifier's norm and head out),
    and the optimizers' state."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tensors = [t for k, t in model.state_dict().items() if k not in ignored]
    tensors += [t for o in optimizers for state in o.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def save_checkpoint(out_dir: Path, model, optimizers, schedulers, state: dict, keep: int, best_step: int) -> Path:
    final = out_dir / "checkpoints" / f"step-{state['step']:08d}"
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    needed = (f"each checkpoint needs {saved_bytes(model, optimizers) / 1e6:,.0f} MB, and training holds up to "
              f"{keep + 2} at once (train.keep_checkpoints {keep} recent ones, the best, and the one being written)")
    with writing(final, tmp, needed):
        tmp.mkdir(parents=True)
        quiet_save_pretrained(model, tmp)
        torch.save({"optimizers": [o.state_dict() for o in optimizers],
                    "schedulers": [sc.state_dict() for sc in schedulers], "rng": rng_states(), **state},
                   tmp / "training_state.pt")
        seal(tmp, final, "COMPLETE", {"step": state["step"]})
    for old in checkpoint_dirs(out_dir)[:-keep]:
        if old.name != f"step-{best_step:08d}":
            shutil.rmtree(old, ignore_errors=True)
    return final


def rng_states() -> dict:
    """Every RNG's state as tensors and plain values (what `torch.load(weights_only=True)` reads)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_states(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    n = rng["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def load_training_state(path: Path) -> dict:
    """The training state without unpickling anything but tensors and plain values."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise DamagedCheckpoint(
            f"{path} holds objects other than tensors and plain values and was not loaded (loading it could run "
            f"code; {str(e).splitlines()[-1].strip() or 'unsupported global'})") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise DamagedCheckpoint(f"{path} cannot be read ({e})") from None


def load_weights(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError) as e:
        raise DamagedCheckpoint(f"{path} cannot be read ({e})") from None


def resume_newest_intact(out_dir: Path, model, optimizers, schedulers) -> tuple[dict | None, Path | None]:
    """The newest checkpoint whose files are intact, loaded into the model, optimizers and
    schedulers: (its state, its folder), or (None, None) when there is none to resume from."""
    for path in reversed(checkpoint_dirs(out_dir)):
        problem = damage(path, "COMPLETE")
        if problem is None:
            try:
                return load_checkpoint(path, model, optimizers, schedulers), path
            except DamagedCheckpoint as e:
                problem = str(e)
        log.warning("checkpoint %s is damaged: %s; skipped, the checkpoint before it is used (a later save at "
                    "that step replaces it)", path.name, problem)
    return None, None


def load_checkpoint(path: Path, model, optimizers, schedulers) -> dict:
    """A checkpoint's state into the model, optimizers and schedulers; nothing is changed when a
    file of it cannot be read (DamagedCheckpoint)."""
    state = load_training_state(path / "training_state.pt")
    weights = load_weights(path / "model.safetensors", device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if not k.startswith("verifier_")]:
        raise CheckpointError(f"checkpoint {path} does not fit the draft: missing {missing}, unexpected {unexpected}")
    for o, sd in zip(optimizers, state["optimizers"], strict=True):
        o.load_state_dict(sd)
    for sc, sd in zip(schedulers, state["schedulers"], strict=True):
        sc.load_state_dict(sd)
    set_rng_states(state["rng"])
    return state


def export_draft(model, checkpoint: Path, out_dir: Path) -> Path:
    """The best checkpoint's weights in bf16, speculators' format: the folder vLLM loads (sealed, its
    checksums in CHECKSUMS.json)."""
    draft = copy.deepcopy(model).cpu()
    draft.load_state_dict(load_weights(checkpoint / "model.safetensors"), strict=False)
    tmp = out_dir / ".tmp-draft"
    shutil.rmtree(tmp, ignore_errors=True)
    draft = draft.to(torch.bfloat16)
    with writing(out_dir / "draft", tmp, f"the bf16 draft needs {saved_bytes(draft) / 1e6:,.0f} MB"):
        quiet_save_pretrained(draft, tmp)
        return seal(tmp, out_dir / "draft", "CHECKSUMS.json", {})


def remove_temporaries(out_dir: Path) -> None:
    """Checkpoint, draft and log files a killed run left half-written; never read, removed here."""
    for tmp in [*out_dir.glob(".tmp-*"), *(out_dir / "checkpoints").glob(".tmp-*")]:
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def load_draft(draft: str | Path, device: torch.device, verifier: str | Path | None = None):
    """A saved draft (speculators' format) in float32, ready to evaluate. The draft's files leave out
    the verifier's token embeddings (vLLM shares the verifier's); they are read from `verifier`, by
    default the folder the draft records."""
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(draft)
    if verifier is not None:
        config.speculators_config.verifier.name_or_path = str(verifier)
    # the attention implementation is chosen when the model is built (speculators sets it in __init__)
    config.transformer_layer_config._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    model = SpeculatorModel.from_pretrained(draft, config=config)
    # from_pretrained leaves the weights the files lack as uninitialised memory, which speculators
    # takes for loaded unless it is NaN: mark the embeddings unloaded so they come from the verifier
    # (else the metrics depend on what that memory held; speculators 0.9, transformers 5)
    torch.nn.init.constant_(model.embed_tokens.weight, torch.nan)
    model.load_verifier_weights()
    return model.to(device).float()
