"""Hugging Face Hub ids as local folders.

A model or dataset id resolves once, before any stage, through huggingface_hub's own cache and
settings (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, the token of HF_TOKEN or `hf auth login`); every
stage then reads the snapshot folder it resolved to. That folder names its repository and commit
(`<cache>/models--org--name/snapshots/<commit>`, huggingface_hub's documented layout), so a
fingerprint or a message reads both from the path alone.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.common.errors import PermanentError

log = logging.getLogger(__name__)

# `org/name` as the Hub spells ids (letters, digits, '-', '_', '.'); a local path of that name wins.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CACHE_PREFIXES = {"models": "model", "datasets": "dataset"}  # cache folder prefix -> repository type


class HubRepoNotFound(PermanentError, FileNotFoundError):
    """A Hub id that is neither in the local cache nor to be had from the Hub; the message says what to do."""


@dataclass(frozen=True)
class HubSnapshot:
    repo_id: str
    repo_type: str  # "model" or "dataset"
    commit: str

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}"


def is_repo_id(text: str) -> bool:
    """Whether a configured path is a Hub id: `org/name`, and no file or folder here has that name."""
    return bool(REPO_ID.fullmatch(text)) and not Path(text).expanduser().exists()


def hub_snapshot(path: str | Path) -> HubSnapshot | None:
    """The repository and commit a folder of huggingface_hub's cache holds, None for any other folder."""
    path = Path(path)
    kind, _, name = path.parent.parent.name.partition("--")
    if path.parent.name != "snapshots" or kind not in CACHE_PREFIXES or "--" not in name:
        return None
    return HubSnapshot(name.replace("--", "/"), CACHE_PREFIXES[kind], path.name)


def download_snapshot(repo_id: str, repo_type: str, revision: str | None = None,
                      allow_patterns: list[str] | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main) holding the files that match
    `allow_patterns` (all when None): from the cache when it has them, else downloaded into it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"Hub {repo_type} {repo_id}" + (f" (revision {revision})" if revision else "")
    download = f"`hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}" \
               f"{f' --revision {revision}' if revision else ''}`"
    try:
        folder = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                        allow_patterns=allow_patterns))
    except RevisionNotFoundError:
        problem = f"{what}: the Hub has no such revision; check the revision's name"
    except GatedRepoError:
        problem = (f"{what} is gated: accept its terms at https://huggingface.co/{repo_id} and set HF_TOKEN "
                   "(or run `hf auth login`)")
    except RepositoryNotFoundError:
        problem = (f"{what} was not found on the Hub: check the name, or for a private repository set HF_TOKEN "
                   "(or run `hf auth login`)")
    except IncompleteSnapshotError as e:
        problem = (f"{what}: the cached copy lacks files and the Hub cannot be reached ({e}); complete it with "
                   f"{download}")
    except LocalEntryNotFoundError:
        problem = (f"{what} is not in the Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE, or no "
                   f"network): download it with {download} where the Hub is reachable (HF_HOME or HF_HUB_CACHE "
                   "naming the same cache), or check the name")
    except HFValidationError as e:
        problem = f"{repo_id} is not a Hub id: {e}"
    except HfHubHTTPError as e:
        problem = f"{what}: the Hub answered {e}; set HF_TOKEN if it needs one, or download it with {download}"
    else:
        log.info("%s: %s", what, folder)
        return folder
    raise HubRepoNotFound(problem)
