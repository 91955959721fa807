"""The command line's logs: everything, tracebacks included, in the run's log file; on the terminal
the same lines without tracebacks, so a failed run ends in its one `error:` line instead of a screen
of Prefect's internals (the file keeps them for whoever needs them)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class WithoutTraceback(logging.Formatter):
    """Another formatter's lines, the exception's traceback left out (it stays in the log file)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


@contextmanager
def run_log(output_dir: Path) -> Iterator[Path]:
    """While inside, every log line (ours and Prefect's) also goes to `<output_dir>/logs/run-<UTC
    time>.log`, and tracebacks stay off the terminal. Enter after Prefect is imported: it sets up its
    own handlers then."""
    path = output_dir / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(path)
    file.setFormatter(logging.Formatter(FORMAT))
    loggers = (logging.getLogger(), logging.getLogger("prefect"))
    for logger in loggers:
        logger.addHandler(file)
        for handler in logger.handlers:
            if handler is not file and isinstance(handler, logging.StreamHandler) \
                    and not isinstance(handler.formatter, WithoutTraceback):
                handler.setFormatter(WithoutTraceback(handler.formatter))
    try:
        yield path
    finally:
        for logger in loggers:
            logger.removeHandler(file)
        file.close()
