"""Where a warm start starts (`train.init_from`): the draft folder, and the extraction manifest of the
data that draft trained on (its lineage), which decides what counts as new and what as replay."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tasks.registry.layout import LINEAGE, Version, current

log = logging.getLogger(__name__)


def warm_start_source(init_from: str | None, registry_dir: str | Path,
                      parent: Version | None = None) -> tuple[str | None, str | None]:
    """(draft folder, manifest it trained on) for `init_from`: None; 'previous', the registry's current
    version (`parent` where the caller read it already; before the first promotion, a new draft); or a draft
    folder, whose lineage is known where it is a registry version's `draft/`."""
    if init_from is None:
        return None, None
    if init_from == "previous":
        parent = parent or current(registry_dir)
        if parent is None:
            log.info("train.init_from: previous, and %s holds no current draft yet: a new draft", registry_dir)
            return None, None
        folder, lineage = parent.draft, parent.lineage()
    else:
        folder = Path(init_from).resolve()
        lineage_file = folder.parent / LINEAGE
        lineage = json.loads(lineage_file.read_text()) if lineage_file.is_file() else {}
    manifest = lineage.get("manifest")
    if manifest and not Path(manifest).is_file():
        log.warning("warm start from %s: the manifest of the data it trained on (%s) is gone; every sample counts "
                    "as new (no replay share)", folder, manifest)
        manifest = None
    return str(folder), manifest
