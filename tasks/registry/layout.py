"""The registry's folders and files, and its versions as read from them (layout: tasks/registry/__init__.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tasks.common.errors import PermanentError

VERSIONS, CURRENT, HISTORY, PICTURE = "versions", "current", "history.jsonl", "acceptance.png"
DRAFT, LINEAGE, SERVE_SCRIPT, SERVE_TEXT = "draft", "lineage.json", "serve.sh", "serve.txt"
REPORTS = ("report.json", "report.md")
LOCK_OWNER = "draft registry"  # how folder_lock names the registry's holder


class RegistryError(PermanentError, ValueError):
    """A registry operation that cannot be done as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Version:
    number: int
    path: Path  # <registry_dir>/versions/<number>
    created: str  # ISO 8601, UTC
    tau: float | None  # vLLM's mean acceptance length, where validation served the draft
    measured_k: int | None  # num_speculative_tokens vLLM measured tau with
    simulated: float | None  # simulated acceptance length from training
    parent: str | None  # the version or draft it was warm-started from
    validation_passed: bool
    validation_verdict: str

    @property
    def draft(self) -> Path:
        return self.path / DRAFT

    def lineage(self) -> dict:
        return json.loads((self.path / LINEAGE).read_text())

    def serve_command(self) -> str:
        """The `vllm serve` line that serves this version (its serve.txt's first line)."""
        return (self.path / SERVE_TEXT).read_text().splitlines()[0]


def versions_dir(registry_dir: str | Path) -> Path:
    return Path(registry_dir) / VERSIONS


def read_version(path: Path) -> Version:
    try:
        lineage = json.loads((path / LINEAGE).read_text())
    except (OSError, ValueError) as e:
        raise RegistryError(f"{path / LINEAGE} cannot be read ({e}); the version is damaged: remove {path} "
                            "(versions are only ever renamed into place whole, so something else changed it)") from None
    parent = lineage.get("parent")
    return Version(number=int(path.name), path=path, created=lineage["created"], tau=lineage["tau_vllm"],
                   measured_k=lineage["num_speculative_tokens_measured"],
                   simulated=lineage["simulated_acceptance_length"], parent=None if parent is None else str(parent),
                   validation_passed=lineage["validation_passed"], validation_verdict=lineage["validation_verdict"])


def versions(registry_dir: str | Path) -> list[Version]:
    """Every version, oldest first; none where nothing was registered. Temporary folders of a
    version being written (or of one a kill interrupted) are not versions."""
    folder = versions_dir(registry_dir)
    numbers = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    return [read_version(folder / str(n)) for n in numbers]


def require_registry(registry_dir: str | Path) -> None:
    """Refuse a folder where no draft was ever registered (a mistyped path, most likely)."""
    if not versions_dir(registry_dir).is_dir():
        raise RegistryError(f"no draft registered in {registry_dir}: is it the registry's folder, "
                            "<registry.path>/<name>?")


def find_version(registry_dir: str | Path, number: int) -> Version:
    path = versions_dir(registry_dir) / str(number)
    if not path.is_dir():
        known = ", ".join(str(v.number) for v in versions(registry_dir))
        raise RegistryError(f"no version {number} in {registry_dir} (its versions: {known})")
    return read_version(path)


def current(registry_dir: str | Path) -> Version | None:
    """The version `current` points at; None before the first promotion."""
    link = Path(registry_dir) / CURRENT
    if not link.is_symlink():
        if link.exists():
            raise RegistryError(f"{link} is not a symlink: the registry only ever makes it one; move it away")
        return None
    target = os.readlink(link)
    number = Path(target).name
    if Path(target).parent != Path(VERSIONS) or not number.isdigit() or not (link.parent / target).is_dir():
        raise RegistryError(f"{link} points at {target}, not a version of this registry; "
                            "`eagle3-pipeline drafts promote N` sets it again")
    return read_version(versions_dir(registry_dir) / number)


def references(registry_dir: str | Path) -> set[str]:
    """The run outputs (absolute paths) that some version's lineage says must be kept."""
    return {path for version in versions(registry_dir) for path in version.lineage()["references"]}
