"""Chat rows -> tokenized samples, in this process or in a pool of processes.

A row is read and normalized by tasks/prepare/chat_data.py, then rendered and masked through the
verifier's chat template by tasks/prepare/chat_template.py. Prepare's time is this tokenization (a
single process managed ~570 conversations/s on an H200 machine's core: 18 minutes for 600k), so rows
go in chunks to one process per core. The samples come back in the rows' order, whatever the number
of processes, with a bounded number of chunks in flight: any number of conversations prepares in the
memory of a few chunks.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from itertools import chain, islice
from multiprocessing import get_context

from tasks.prepare.chat_data import Dropped, Row, read_conversation
from tasks.prepare.chat_template import tokenize_conversation

log = logging.getLogger(__name__)

CHUNK_ROWS = 1000  # rows per task: large enough that a chunk's tokenization dwarfs its pickling
MAX_WORKERS = 16  # past this the parent (reading rows, writing samples) is the bottleneck


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool  # cut at max_seq_len
    turns_cut: int  # turns left out after an empty one


def tokenize_row(tokenizer, max_seq_len: int, end_of_turn: frozenset[int], row: Row) -> Sample | Dropped:
    conversation = row.data if isinstance(row.data, Dropped) else read_conversation(row.data)
    if isinstance(conversation, Dropped):
        return conversation
    tokenized = tokenize_conversation(tokenizer, conversation.messages, max_seq_len, end_of_turn)
    if isinstance(tokenized, Dropped):
        return tokenized
    input_ids, loss_mask, truncated = tokenized
    return Sample(input_ids, loss_mask, truncated, conversation.turns_cut)


def default_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def tokenized_rows(rows: Iterable[Row], tokenizer, load_tokenizer: Callable[[], object], max_seq_len: int,
                   end_of_turn: frozenset[int], workers: int) -> Iterator[tuple[Row, Sample | Dropped]]:
    """Each row with its sample (or why it was dropped), in order. `tokenizer` serves this process;
    `load_tokenizer` (picklable: a module-level function or a partial of one) loads the same one in
    each worker process. Rows that fit one chunk, or `workers` <= 1, stay in this process."""
    rows = iter(rows)
    chunks = iter(lambda: list(islice(rows, CHUNK_ROWS)), [])
    first, second = next(chunks, []), next(chunks, [])
    chunks = chain([c for c in (first, second) if c], chunks)
    if not second or workers <= 1:
        for chunk in chunks:
            yield from ((row, tokenize_row(tokenizer, max_seq_len, end_of_turn, row)) for row in chunk)
        return
    log.info("prepare: tokenizing in %d processes, chunks of %d rows", workers, CHUNK_ROWS)
    # spawn, not fork: the flow's process runs threads (Prefect's, the tokenizer's) that a fork would
    # copy mid-use; a spawned worker starts only when a chunk waits and none is idle
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_start_worker,
                             initargs=(load_tokenizer, max_seq_len, end_of_turn)) as pool:
        in_flight: deque = deque()
        for chunk in chunks:
            in_flight.append((chunk, pool.submit(_tokenize_chunk, chunk)))
            if len(in_flight) >= 2 * workers:  # every worker busy, one chunk queued behind each
                chunk, done = in_flight.popleft()
                yield from zip(chunk, done.result(), strict=True)
        while in_flight:
            chunk, done = in_flight.popleft()
            yield from zip(chunk, done.result(), strict=True)


_worker_tokenize: Callable[[Row], Sample | Dropped] | None = None  # this worker process's, set once


def _start_worker(load_tokenizer: Callable[[], object], max_seq_len: int, end_of_turn: frozenset[int]) -> None:
    global _worker_tokenize
    _worker_tokenize = partial(tokenize_row, load_tokenizer(), max_seq_len, end_of_turn)


def _tokenize_chunk(chunk: list[Row]) -> list[Sample | Dropped]:
    return [_worker_tokenize(row) for row in chunk]
