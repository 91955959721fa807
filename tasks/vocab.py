"""Stage 3, vocab: the draft's vocabulary, the most frequent supervised (assistant) tokens.

speculators' layout and its own builder (`build_vocab_mappings_from_distribution`):
- `d2t` int64 [draft_vocab]: offsets, target id = draft index + d2t[index] (what vLLM reads);
- `t2d` bool [verifier_vocab]: the selected target ids, sum = draft_vocab.
Saved as `d2t.npy` / `t2d.npy` (the files speculators' trainer takes) under
`<output_dir>/vocab/<fingerprint>/` with `report.json`, including the share of supervised tokens
the draft vocabulary covers (tokens outside it can never be drafted) and each file's checksum
(tasks/common/sealed.py): a folder whose files changed or went missing is built again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tasks.common.sealed import damage, seal
from tasks.common.verifier import inspect_verifier
from tasks.prepare.dataset import load_prepared

log = logging.getLogger(__name__)

VOCAB_FORMAT = "vocab-v1"


@dataclass(frozen=True)
class VocabResult:
    path: str
    fingerprint: str
    draft_vocab_size: int
    verifier_vocab_size: int
    coverage: float  # share of supervised tokens whose id is in the draft vocabulary
    distinct_supervised_tokens: int


def token_frequencies(prepared, vocab_size: int) -> np.ndarray:
    """Counts of each token id over the loss-masked (assistant) tokens."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in prepared.with_format("numpy").iter(batch_size=1024):
        ids = np.concatenate(batch["input_ids"]) if len(batch["input_ids"]) else np.zeros(0, np.int64)
        mask = np.concatenate(batch["loss_mask"]).astype(bool) if len(batch["loss_mask"]) else np.zeros(0, bool)
        supervised = ids[mask]
        if supervised.size and supervised.max() >= vocab_size:
            raise ValueError(f"token id {supervised.max()} is outside the verifier's vocabulary ({vocab_size})")
        counts += np.bincount(supervised, minlength=vocab_size)
    return counts


def vocab_fingerprint(prepared_fp: str, draft_vocab_size: int, verifier_vocab_size: int) -> str:
    parts = {"format": VOCAB_FORMAT, "prepared": prepared_fp, "draft": draft_vocab_size, "verifier": verifier_vocab_size}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def vocab_folder(output_dir: str | Path, prepared_fp: str, draft_vocab_size: int,
                 verifier_vocab: int) -> tuple[Path, str]:
    """(the folder, the fingerprint) of a vocabulary; the draft's size capped at the verifier's."""
    fingerprint = vocab_fingerprint(prepared_fp, min(draft_vocab_size, verifier_vocab), verifier_vocab)
    return Path(output_dir) / "vocab" / fingerprint[:16], fingerprint


def vocab_damage(output_dir: str | Path, prepared_fp: str, draft_vocab_size: int, verifier_path: str) -> str | None:
    """Why a vocabulary written before can no longer be used (a file changed or gone), else None
    (also when none was written yet)."""
    final, _ = vocab_folder(output_dir, prepared_fp, draft_vocab_size, inspect_verifier(verifier_path).vocab_size)
    return damage(final, "report.json") if final.is_dir() else None


def read_result(final: Path) -> VocabResult:
    """The folder's report, its path being where the folder is now (a moved output folder reads its own)."""
    fields = {k: v for k, v in json.loads((final / "report.json").read_text()).items() if k not in ("files", "path")}
    return VocabResult(path=str(final), **fields)


def build_vocab(prepared_path: str, prepared_fp: str, verifier_path: str, output_dir: str | Path,
                draft_vocab_size: int) -> VocabResult:
    verifier_vocab = inspect_verifier(verifier_path).vocab_size
    draft = min(draft_vocab_size, verifier_vocab)
    if draft < draft_vocab_size:
        log.info("draft vocabulary capped at the verifier's %d tokens", verifier_vocab)
    final, fingerprint = vocab_folder(output_dir, prepared_fp, draft, verifier_vocab)
    if final.is_dir():
        problem = damage(final, "report.json")
        if problem is None:
            return read_result(final)
        log.warning("vocab %s is damaged (%s): built again", final, problem)

    # imported here: speculators (and the torch and transformers modules it loads) takes seconds to
    # import, paid by every process that imports the flow otherwise, the CLI's included
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts = token_frequencies(load_prepared(prepared_path), verifier_vocab)
    nonzero = np.nonzero(counts)[0]
    d2t, t2d = build_vocab_mappings_from_distribution(
        {int(i): int(counts[i]) for i in nonzero}, draft_vocab_size=draft, target_vocab_size=verifier_vocab
    )
    coverage = float(counts[t2d.numpy()].sum() / max(1, counts.sum()))
    result = VocabResult(str(final), fingerprint, draft, verifier_vocab, round(coverage, 6), int(len(nonzero)))

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        np.save(tmp / "d2t.npy", d2t.numpy())
        np.save(tmp / "t2d.npy", t2d.numpy())
        np.save(tmp / "token_freq.npy", counts)
        seal(tmp, final, "report.json", {k: v for k, v in asdict(result).items() if k != "path"})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("vocab: %d draft tokens cover %.1f%% of %d supervised tokens (%d distinct) -> %s",
             draft, 100 * coverage, counts.sum(), len(nonzero), final)
    return result


def load_vocab(path: str | Path, verifier_vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d), checked against each other and, if given, the verifier's vocabulary."""
    path = Path(path)
    d2t = torch.from_numpy(np.load(path / "d2t.npy"))
    t2d = torch.from_numpy(np.load(path / "t2d.npy"))
    check_vocab(d2t, t2d, verifier_vocab_size, where=str(path))
    return d2t, t2d


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, verifier_vocab_size: int | None, where: str) -> None:
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"{where}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if verifier_vocab_size is not None and t2d.numel() != verifier_vocab_size:
        raise ValueError(f"{where}: t2d covers {t2d.numel()} token ids but the verifier's vocabulary has "
                         f"{verifier_vocab_size}: this mapping was built for another verifier")
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"{where}: t2d selects {int(t2d.sum())} ids but d2t has {d2t.numel()} entries")
    targets = torch.arange(d2t.numel()) + d2t
    if targets.min() < 0 or targets.max() >= t2d.numel() or not t2d[targets].all():
        raise ValueError(f"{where}: d2t offsets point outside the ids t2d selects")
