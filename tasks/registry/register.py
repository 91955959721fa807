"""A new version: the draft folder and its validation report copied into the registry with their
lineage and the line that serves them, written under a temporary name, fsynced and renamed into
place, so that a kill leaves no version or a whole one."""

from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

import xxhash

from tasks.common.folder_lock import folder_lock
from tasks.common.sealed import file_digest, fsync_path
from tasks.registry.gate import measured, validation_verdict
from tasks.registry.layout import (
    DRAFT,
    LINEAGE,
    LOCK_OWNER,
    REPORTS,
    SERVE_SCRIPT,
    SERVE_TEXT,
    RegistryError,
    Version,
    read_version,
    versions,
    versions_dir,
)
from tasks.validate.serve_line import serve_lines

log = logging.getLogger(__name__)

# what the caller knows of the run; the registry adds what it reads from the draft and the report
LINEAGE_KEYS = {
    "verifier": "the verifier's path or Hub id",
    "verifier_fingerprint": "the verifier's fingerprint",
    "data_fingerprints": "the fingerprints of the data the draft was trained on",
    "parent": "the version or draft it was warm-started from (None: a fresh draft)",
    "config": "the run's configuration, as a dict",
    "references": "absolute paths of the run's outputs that `gc` must keep",
}


def draft_digest(draft_dir: Path) -> str:
    """One checksum of a draft folder: its files' names and contents."""
    h = xxhash.xxh3_128()
    for path in sorted(p for p in draft_dir.rglob("*") if p.is_file()):
        h.update(f"{path.relative_to(draft_dir)}\0{file_digest(path)}\0".encode())
    return h.hexdigest()


def check_inputs(draft_dir: Path, report_dir: Path, lineage: dict) -> dict:
    """The validation report, once the draft, the report and the lineage are all there."""
    if not (draft_dir / "config.json").is_file():
        raise RegistryError(f"{draft_dir} is not a draft folder (no config.json): register the folder training wrote "
                            "(train/<fingerprint>/draft)")
    missing = [name for name in REPORTS if not (report_dir / name).is_file()]
    if missing:
        raise RegistryError(f"{report_dir} lacks {', '.join(missing)}: register a draft with the folder its "
                            "validation wrote (validation/<fingerprint>)")
    absent = [f"{key} ({what})" for key, what in LINEAGE_KEYS.items() if key not in lineage]
    if absent:
        raise RegistryError("the lineage lacks " + "; ".join(absent))
    relative = [p for p in lineage["references"] if not Path(p).is_absolute()]
    if relative:
        raise RegistryError(f"lineage references must be absolute paths, not {', '.join(map(str, relative))}")
    return json.loads((report_dir / "report.json").read_text())


def register(registry_dir: str | Path, draft_dir: str | Path, report_dir: str | Path, lineage: dict) -> Version:
    """Register `draft_dir`, validated in `report_dir`, as the next version (not made current: see
    promotion.py). `lineage` holds LINEAGE_KEYS; τ, the per-position acceptance and the simulated
    acceptance are read from the report. A draft registered before (same files) is that version again."""
    registry_dir, draft_dir, report_dir = Path(registry_dir).resolve(), Path(draft_dir), Path(report_dir)
    report = check_inputs(draft_dir, report_dir, lineage)
    digest = draft_digest(draft_dir)
    with folder_lock(registry_dir, LOCK_OWNER):
        for version in versions(registry_dir):
            if version.lineage()["draft_digest"] == digest:
                log.info("registry: %s is already version %d (same files)", draft_dir, version.number)
                return version
        folder = versions_dir(registry_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for abandoned in folder.glob(".tmp-*"):  # a version a kill interrupted: we hold the lock, nobody writes it
            shutil.rmtree(abandoned)
        number = max((v.number for v in versions(registry_dir)), default=0) + 1
        final, tmp = folder / str(number), folder / f".tmp-{number}"
        shutil.copytree(draft_dir, tmp / DRAFT)
        for name in REPORTS:
            shutil.copy2(report_dir / name, tmp / name)
        write_lineage(tmp, final, report, {**lineage, "draft_source": str(draft_dir.resolve()),
                                           "draft_digest": digest, "validation_report": str(report_dir.resolve())},
                      number)
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_path(folder)
    log.info("registry: %s registered as version %d in %s", draft_dir, number, registry_dir)
    return read_version(final)


def write_lineage(tmp: Path, final: Path, report: dict, lineage: dict, number: int) -> None:
    """lineage.json, serve.sh and serve.txt of version `number`, whose files will be at `final`."""
    tau, k, per_position = measured(report)
    passed, verdict = validation_verdict(report)
    trust_remote_code = bool(lineage["config"].get("verifier", {}).get("trust_remote_code"))
    serve = serve_lines(str(lineage["verifier"]), str(final / DRAFT), per_position, trust_remote_code=trust_remote_code)
    record = {**lineage, "version": number, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "validation_passed": passed, "validation_verdict": verdict, "tau_vllm": tau,
              "num_speculative_tokens_measured": k, "per_position_acceptance": per_position,
              "simulated_acceptance_length": report.get("simulated_acceptance_length"),
              "serve": {"command": serve.command, "python": serve.python, "k": serve.k, "why": serve.why}}
    (tmp / LINEAGE).write_text(json.dumps(record, indent=1, default=str) + "\n")
    (tmp / SERVE_TEXT).write_text(f"{serve.command}\n\n# Python\n{serve.python}\n\n# {serve.why}\n")
    script = tmp / SERVE_SCRIPT
    script.write_text(f"#!/bin/sh\n# Serves version {number} of this draft registry.\n# {serve.why}\n"
                      f"exec {serve.command} \"$@\"\n")
    script.chmod(0o755)


def fsync_tree(root: Path) -> None:
    """Every file and folder under `root`, `root` last: on disk before the rename publishes them."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        fsync_path(path)
    fsync_path(root)
