"""torch.compile's work kept with the run's outputs, so that a training process on a fresh machine (a
resume on another node, a scheduled retraining in a new container) loads the compiled draft instead of
compiling it again. On a cold cache the SmolLM2 preset's first step came 151 s after its process
started, against 30 s on the warm cache of the same H100 (docs/BENCHMARKS.md, eleventh measurement);
the local cache (/tmp/torchinductor_$USER) is what a fresh machine lacks. With it wiped, the files kept
here brought the first step to 8 s from the training loop's start, against 71 s cold (twelfth).

The files are torch's portable cache artifacts ("mega-cache": compiled graphs, AOTAutograd entries and
the kernels bundled with them), written by rank 0 once its first validation has compiled the last
graphs a run needs (on-policy refinement's come later, and are compiled again), and hot-loaded into
the local cache as every process starts. One folder per torch build and device (a GPU's kernels are no
use to another); in it, one file per set of compiled graphs, named by that set, so runs of other
settings in the same output folder keep theirs. A cache never fails a run: a file that cannot be read
or written is logged and left.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class CompileCache:
    def __init__(self, folder: Path, device: torch.device):
        build = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.folder = Path(folder) / re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"torch-{torch.__version__}-{build}")
        self.saved = False

    def load(self) -> int:
        """Hot-load every file of this build into the local cache; the number of artifacts loaded."""
        loaded = 0
        for path in sorted(self.folder.glob("*.bin")) if self.folder.is_dir() else []:
            try:
                info = torch.compiler.load_cache_artifacts(path.read_bytes())
            except Exception as e:  # torch logs and skips what it cannot read; this is the rest
                log.warning("compile cache: %s not loaded (%s); what it held is compiled again", path, e)
                continue
            loaded += len(artifact_keys(info))
        if loaded:
            log.info("compile cache: %d artifacts loaded from %s (compiled by an earlier training process of this "
                     "output folder)", loaded, self.folder)
        return loaded

    def save(self) -> Path | None:
        """Once per process, when what it compiles is compiled (after its first validation): write what
        it compiled or loaded, unless a file holds that set already; the file written. Once, because
        torch's loader (2.11-2.13) keeps only the last batch of each kind when a process serialized its
        artifacts twice (CacheArtifactManager.deserialize makes a dict of (kind, batch) pairs)."""
        if self.saved:
            return None
        self.saved = True
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as e:
            log.warning("compile cache: not saved (%s)", e)
            return None
        if saved is None:  # nothing compiled (on a CPU, speculators does not compile the draft)
            return None
        data, info = saved
        keys = artifact_keys(info)
        path = self.folder / f"{hashlib.sha256(chr(10).join(keys).encode() if keys else data).hexdigest()[:16]}.bin"
        if path.is_file():  # another process kept the same set
            return None
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # never read as a cache file (*.bin)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("compile cache: %s not written (%s)", path, e)
            return None
        log.info("compile cache: %d artifacts (%.1f MB) kept in %s for training processes on other machines",
                 len(keys), len(data) / 1e6, path)
        return path


def artifact_keys(info) -> list[str]:
    """The artifacts a CacheInfo names, as "kind:key" (none where this torch build's CacheInfo does not
    list them by kind)."""
    by_kind = getattr(info, "artifacts", None) or {}
    return sorted(f"{kind}:{key}" for kind, keys in by_kind.items() for key in keys)
