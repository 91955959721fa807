"""A real huggingface_hub cache laid out on disk, as `hf download` leaves it: `<kind>--org--name/`
with the files' bytes under `blobs/`, `snapshots/<commit>/` of links to them, and `refs/<branch>`
holding the commit. No hub is reachable from the tests: they read such a cache with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def lay_out_repo(hub_cache: Path, kind: str, repo_id: str, files: dict[str, bytes], ref: str = "main") -> Path:
    """A snapshot of `files` (path in the repository -> bytes) as the commit `ref` points at (a
    commit hash made from the files and the ref, so two refs give two commits); its folder."""
    repo = hub_cache / f"{kind}s--{repo_id.replace('/', '--')}"
    blobs = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    commit = hashlib.sha1(repr((sorted(blobs.items()), ref)).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / blobs[name]
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():  # two commits share the bytes they have in common
            blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    """The environment of a process that reads the cache under `hf_home` and never the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
