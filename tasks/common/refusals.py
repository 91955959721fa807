"""How a CLI command ends when it is refused: one `error:` line on stderr and an exit code a script can
test: 2 when the same command would be refused the same way (bad input, a `PermanentError`), 3 when
another run holds the folder (`FolderLockedError`: the same command may work once that run ends)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps

from tasks.common.errors import PermanentError
from tasks.common.folder_lock import FolderLockedError

REFUSED, FOLDER_IN_USE = 2, 3


def refusal_exit(error: PermanentError | FolderLockedError) -> int:
    """The `error:` line for `error`, and the exit code it means."""
    print(f"error: {error}", file=sys.stderr)
    return FOLDER_IN_USE if isinstance(error, FolderLockedError) else REFUSED


def exits_on_refusal(command: Callable[..., int]) -> Callable[..., int]:
    """`command` (returning its exit code), with its refusals ended as `refusal_exit` says."""

    @wraps(command)
    def run(*args, **kwargs) -> int:
        try:
            return command(*args, **kwargs)
        except (PermanentError, FolderLockedError) as e:
            return refusal_exit(e)

    return run
