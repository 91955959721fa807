"""Which failures a retry can change (tasks/common/errors.py): a file a retry cannot create, a
permission a retry cannot grant, a model folder missing a file are not retried; a full disk or a
lost device are."""

from __future__ import annotations

import errno

from tasks.common.errors import is_deterministic


def test_missing_files_and_refused_permissions_are_not_retried(tmp_path):
    for exc in (FileNotFoundError(errno.ENOENT, "No such file", str(tmp_path / "d2t.npy")),
                PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".lock")),
                OSError("Can't load image processor for '/models/kimi'. If you were trying to load it from "
                        "'https://huggingface.co/models', make sure ... preprocessor_config.json file"),
                OSError("/models/x does not appear to have a file named config.json")):
        assert is_deterministic(exc), exc


def test_a_full_disk_and_a_lost_device_are_retried():
    for exc in (OSError(errno.ENOSPC, "No space left on device"), RuntimeError("CUDA error: an illegal memory access"),
                MemoryError()):
        assert not is_deterministic(exc), exc
