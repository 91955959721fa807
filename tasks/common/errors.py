"""Which failures a retry can change.

A stage's task retries a failure only if it is *transient*: an OOM kill, a CUDA abort, a lost
worker, a flaky disk or network. A *deterministic* failure (bad input, a bad setting, a verifier
the backend cannot load, a draft that fails its checks) fails at once: retrying it would only
repeat the same error after a back-off.

- Errors the project raises for bad input subclass `PermanentError` (with the builtin they
  always had: `VerifierError(PermanentError, ValueError)`).
- Of Python's own, the errors of a program meeting input it cannot handle are deterministic:
  ValueError, TypeError, LookupError, AttributeError, NotImplementedError, ImportError, and the
  file errors a retry cannot mend (a missing file, a permission refused). So is the
  OSError transformers raises for a model folder that lacks a file ("Can't load image processor
  ..."). Others (RuntimeError, which CUDA and NCCL faults are; other OSErrors, a full disk and a
  stale mount among them; MemoryError) are transient.
- An exception may carry `deterministic = True/False` to say so itself (a worker's exception
  rebuilt in its parent process, tasks/common/workers.py).
"""

from __future__ import annotations

DETERMINISTIC_BUILTINS = (ValueError, TypeError, LookupError, AttributeError, NotImplementedError, ImportError,
                          FileNotFoundError, PermissionError)
MISSING_FILE_MESSAGES = ("Can't load", "does not appear to have a file named")  # transformers' OSErrors


class PermanentError(Exception):
    """Retrying cannot change this outcome; the message says what to fix."""


def is_deterministic(exc: BaseException) -> bool:
    flag = getattr(exc, "deterministic", None)
    if isinstance(flag, bool):
        return flag
    if isinstance(exc, OSError) and any(m in str(exc) for m in MISSING_FILE_MESSAGES):
        return True
    return isinstance(exc, (PermanentError, *DETERMINISTIC_BUILTINS))


def describe(exc: BaseException) -> str:
    """For a user: the exception's type and message."""
    name = getattr(exc, "type_name", None) or type(exc).__name__
    message = str(exc).strip()
    return f"{name}: {message}" if message else name
