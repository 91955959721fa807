"""`eagle3-pipeline gc OUTPUT_DIR [--dry-run] [--keep-runs N] [--registry PATH]`: remove the outputs
that no kept run references, and say how many files and bytes that was.

- Kept runs: the newest N run records (`OUTPUT_DIR/runs/*.json`, by modification time) and every
  version of the draft registry (`<registry>/*/versions/*/lineage.json`). Each lists under
  "references" the absolute paths of what its run used: prepared data, regenerated answers, the
  extraction manifest, the vocabulary, the training and validation folders. A referenced manifest
  keeps the shards it lists.
- Candidates: the entries directly under OUTPUT_DIR/{prepared,regenerated,vocab,train,validation,
  synthesized}, and the shard and manifest files of OUTPUT_DIR/hidden_states. Nothing else is ever
  touched (.prefect, logs, runs, the registry, journals, locks).
- Without any run record nothing is removed: what the runs need would be unknown. A record that cannot
  be read stops it likewise. A folder a running run holds (tasks/common/folder_lock.py) refuses the
  whole collection: what that run made is in no record yet.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.folder_lock import busy, folder_lock, held_by_live_process
from tasks.common.progress import format_bytes
from tasks.common.refusals import exits_on_refusal
from tasks.extract.shards import QUARANTINE_SUFFIX, ShardError, read_manifest

STAGE_FOLDERS = ("prepared", "regenerated", "vocab", "train", "validation", "synthesized")
SHARD_FOLDER = "hidden_states"
SHARD_FILES = ("shard-*.safetensors", f"shard-*.safetensors{QUARANTINE_SUFFIX}", "manifest-*.json",
               "stream-manifest-*.json")
KEEP_RUNS = 3


class GcError(PermanentError, ValueError):
    """The collection cannot know what the runs need; nothing was removed."""


@dataclass
class Collection:
    """What a collection keeps and removes (or, dry, would remove)."""

    runs: list[Path]  # the kept run records
    versions: list[Path]  # the registry's lineage files
    removed: dict[Path, tuple[int, int]] = field(default_factory=dict)  # entry -> (files, bytes)

    @property
    def files(self) -> int:
        return sum(files for files, _ in self.removed.values())

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.removed.values())


def collect(output_dir: str | Path, *, dry_run: bool = False, keep_runs: int = KEEP_RUNS,
            registry: str | Path | None = None) -> Collection:
    """Remove (with `dry_run`, only list) what no kept run references (module docstring)."""
    if keep_runs < 1:
        raise GcError(f"--keep-runs {keep_runs}: keep at least one run")
    output = Path(output_dir).resolve()
    if not output.is_dir():
        raise GcError(f"{output} is not a folder")
    registry = Path(registry).resolve() if registry is not None else output / "registry"
    if not registry.is_dir() and registry != output / "registry":
        raise GcError(f"the registry {registry} is not a folder")
    records = sorted((output / "runs").glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    if not records:
        raise GcError(f"no run record in {output / 'runs'}: without one nothing is known to be needed, so nothing "
                      "is removed")
    collection = Collection(records[-keep_runs:], sorted(registry.glob("*/versions/*/lineage.json")))
    references = {reference for path in collection.runs + collection.versions for reference in read_references(path)}
    candidates = [entry for stage in STAGE_FOLDERS if (output / stage).is_dir()
                  for entry in sorted((output / stage).iterdir()) if not entry.name.startswith(".")]
    shard_dir = output / SHARD_FOLDER
    shard_files = sorted({p for pattern in SHARD_FILES for p in shard_dir.glob(pattern)}) if shard_dir.is_dir() else []
    with ExitStack() as locks:  # no run starts in the folder meanwhile; one running refuses the collection
        locks.enter_context(folder_lock(output, "eagle3-pipeline"))
        if shard_dir.is_dir():
            locks.enter_context(folder_lock(shard_dir, "eagle3-pipeline"))
        for folder in candidates:
            if folder.is_dir() and held_by_live_process(folder):
                raise busy(folder, "eagle3-pipeline")
        listed = shards_listed(references, shard_dir)
        for entry in candidates:
            if not referenced(entry, references):
                collection.removed[entry] = remove(entry, dry_run)
        for path in shard_files:
            if not referenced(path, references) and path.name.removesuffix(QUARANTINE_SUFFIX) not in listed:
                collection.removed[path] = remove(path, dry_run)
    return collection


def read_references(path: Path) -> set[Path]:
    try:
        references = json.loads(path.read_text())["references"]
        if not isinstance(references, list) or not all(isinstance(r, str) for r in references):
            raise ValueError("'references' is not a list of paths")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GcError(f"{path} cannot be read ({type(e).__name__}: {e}): what its run needs is unknown, so nothing is "
                      "removed; repair or delete it") from None
    return {Path(reference).resolve() for reference in references}


def shards_listed(references: set[Path], shard_dir: Path) -> set[str]:
    """Names of the shards the referenced manifests of `shard_dir` list."""
    names: set[str] = set()
    for reference in references:
        if reference.parent == shard_dir and reference.is_file():
            try:
                names |= {shard["name"] for shard in read_manifest(reference)["shards"]}
            except ShardError as e:
                raise GcError(f"{e}; which shards it needs is unknown, so nothing is removed") from None
    return names


def referenced(path: Path, references: set[Path]) -> bool:
    """`path` is referenced, lies in a referenced folder or holds a referenced path."""
    return path in references or any(parent in references for parent in path.parents) or any(
        path in reference.parents for reference in references)


def remove(path: Path, dry_run: bool) -> tuple[int, int]:
    """(files, bytes) under `path` (a link counts as one file, never followed); removed unless `dry_run`."""
    if path.is_dir() and not path.is_symlink():
        sizes = [os.lstat(os.path.join(folder, name)).st_size
                 for folder, _, files in os.walk(path) for name in files]
        if not dry_run:
            shutil.rmtree(path)
    else:
        sizes = [path.lstat().st_size]
        if not dry_run:
            path.unlink()
    return len(sizes), sum(sizes)


@exits_on_refusal
def gc_command(output_dir: str, *, dry_run: bool, keep_runs: int, registry: str | None) -> int:
    """The CLI's `gc`: prints what was (or would be) removed; refused (2, GcError) or a run holds the folder
    (3): nothing was removed."""
    collection = collect(output_dir, dry_run=dry_run, keep_runs=keep_runs, registry=registry)
    output = Path(output_dir).resolve()
    for path, (files, size) in collection.removed.items():
        print(f"{'would remove' if dry_run else 'removed'} {path.relative_to(output)} ({files} files, "
              f"{format_bytes(size)})")
    print(f"kept what {len(collection.runs)} run record(s) and {len(collection.versions)} registry version(s) "
          "reference")
    verb = "would remove" if dry_run else "removed"
    print(f"{verb} {collection.files} files, {collection.bytes:,} bytes ({format_bytes(collection.bytes)})")
    return 0
