"""Checks before the flow's first task: everything that can be known without loading a model.

A run that would fail on a missing folder, an unreadable file, an empty data source, an
unwritable output folder or auxiliary layers outside the verifier's depth fails here, in a
second, with one message naming the problem, instead of minutes later in a stage (and its
retries). So does a run whose draft vLLM could not serve for live validation when that is
required (where it is only wanted, the run goes on with a warning and validation skips serving).
Takes a config whose `demo://` paths are resolved (tasks/common/demo_assets.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.verifier import TOKENIZER_FILES, check_tokenizer_files, inspect_verifier
from tasks.common.vllm_support import EXTRACTION_ADVICE, eagle3_support
from tasks.prepare.chat_data import source_files

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
        raise PreflightError(f"verifier.path {verifier.path} holds no weight files (*.safetensors, *.bin, *.gguf)")
    for name in ("config.json", *verifier.weight_files, *(n for n in TOKENIZER_FILES if (verifier.path / n).exists())):
        check_readable(verifier.path / name, "verifier file")
    check_tokenizer_files(verifier.path, config.verifier.trust_remote_code)


def is_blank(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(1 << 16)
    return not head.strip() and path.stat().st_size <= len(head)


def check_data(config) -> None:
    """Every source exists and is readable, a file named in the config is not empty, and some
    source holds data (a drop folder may be empty until data arrives, if another source has some)."""
    has_data = False
    for source in config.data.sources:
        try:
            files = source_files(source)
        except FileNotFoundError as e:
            raise PreflightError(f"data.sources: {e}") from None
        for path in files:
            if path.is_dir():  # a `datasets` folder
                has_data = True
                continue
            check_readable(path, "data file")
            if not is_blank(path):
                has_data = True
            elif path == Path(source):
                raise PreflightError(f"data.sources: {path} is empty")
    if not has_data and not config.data.synthesize.prompts:  # with none, the verifier's own prompts are the data
        raise PreflightError(f"data.sources {config.data.sources} hold no data (no non-empty .json or .jsonl file)")


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


def check_live_validation(config) -> str | None:
    """Whether vLLM here can serve the verifier with an EAGLE-3 draft, as validation.live asks:
    raises when it is required and cannot; returns the reason live validation will be skipped
    when it is only wanted (`auto`), None when it will run or is not asked for."""
    if config.validation.live == "skip":
        return None
    support = eagle3_support(inspect_verifier(config.verifier.path))
    if support.supported:
        return None
    if config.validation.live == "required":
        raise PreflightError(f"validation.live: required, but {support.problem}; set validation.live: auto to "
                             "train anyway and validate statically, or skip")
    return f"{support.problem}: live validation will be skipped (validation.live: auto)"


def check_vllm_extraction(config) -> None:
    """extract.backend: vllm needs a vLLM that serves the verifier with EAGLE-3 drafts."""
    if config.extract.backend != "vllm":
        return
    support = eagle3_support(inspect_verifier(config.verifier.path))
    if not support.supported:
        raise PreflightError(f"extract.backend: vllm, but {support.problem}; {EXTRACTION_ADVICE}")


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
    # top-level names only: finding `ray.train` would import Ray, before a Ray of the run's own is
    # told to stay on the loopback interface (flows/ray_stages.py, read when Ray is imported)
    if config.cluster.executor == "ray" and not all(importlib.util.find_spec(m) for m in ("ray", "prefect_ray")):
        raise PreflightError("cluster.executor 'ray' needs prefect-ray and Ray Train: pip install -e '.[ray]' "
                             "(make install does)")
    if os.environ.get("PREFECT_HOME"):
        check_writable(Path(os.environ["PREFECT_HOME"]), "PREFECT_HOME")
