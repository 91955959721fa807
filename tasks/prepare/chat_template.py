"""A conversation -> `input_ids` and an assistant-only loss mask, through the verifier's own chat template.

The loss mask is derived without `{% generation %}` markers (most templates, SmolLM2's included,
have none): the conversation is rendered once, each assistant text is located in the rendering
(it starts after the rendering of the conversation so far plus the generation prompt), and the
tokens whose characters lie inside an assistant text are the supervised ones. Template tokens
(role headers, end-of-turn markers) are never supervised.

- Tool use (OpenAI's format): tool calls and tool results are rendered by the template where it
  renders them (probed once per template); otherwise a call is written as text after the
  assistant's own text (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) and a result
  becomes a user turn. Either way they are context: only the text the assistant wrote is supervised.
- Text is tokenized as text: a message that contains a control token's string (`<|im_end|>`)
  gets the tokens of those characters, never the control token, which only the template places.
- A template that renders only OpenAI's list of content parts (Llava's: a plain string renders as
  nothing) gets each text as one text part.
"""

from __future__ import annotations

import bisect
import json
import re

from tasks.prepare.chat_data import Dropped

PROBE_CALL, PROBE_RESULT, PROBE_TEXT = "zq_probe_function", "zq_probe_result", "zq_probe_text"
_template_support: dict[str, tuple[bool, bool, bool]] = {}


def template_support(tokenizer) -> tuple[bool, bool, bool]:
    """Whether the chat template renders (assistant tool calls, tool-role messages, text given as a
    plain string rather than as a list of content parts)."""
    template = tokenizer.chat_template
    if template not in _template_support:
        call = {"id": "call_0", "type": "function", "function": {"name": PROBE_CALL, "arguments": {"x": 1}}}
        asked = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        answered = [*asked, {"role": "tool", "content": PROBE_RESULT, "tool_call_id": "call_0", "name": PROBE_CALL},
                    {"role": "assistant", "content": "ok"}]
        plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE_TEXT}]
        as_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in plain]
        renders_strings = PROBE_TEXT in render(tokenizer, plain) or PROBE_TEXT not in render(tokenizer, as_parts)
        _template_support[template] = (PROBE_CALL in render(tokenizer, asked),
                                       PROBE_RESULT in render(tokenizer, answered), renders_strings)
    return _template_support[template]


def render(tokenizer, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # templates raise on what they do not take (roles, missing keys)
        return ""


def call_arguments(call: dict) -> dict:
    """A tool call in the form templates take: arguments as a dict (OpenAI sends a JSON string)."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"name": function.get("name", ""), "arguments": arguments}


def for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """The messages as this template renders them (module docstring); an assistant message whose
    content gained text keeps the assistant's own text in `supervised`; a message whose text goes to
    the template as content parts keeps it in `text`."""
    renders_calls, renders_tool_role, renders_strings = template_support(tokenizer)
    out: list[dict] = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls") and renders_calls:
            message["tool_calls"] = [{**c, "type": "function", "function": call_arguments(c)}
                                     for c in message["tool_calls"]]
        elif message.get("tool_calls"):
            written = "\n".join(f"<tool_call>\n{json.dumps(call_arguments(c), ensure_ascii=False)}\n</tool_call>"
                                for c in message["tool_calls"])
            message = {"role": "assistant", "supervised": message["content"],
                       "content": f"{message['content']}\n{written}" if message["content"] else written}
        if message["role"] == "tool" and not renders_tool_role:
            message = {"role": "user", "content": message["content"]}
            if out and out[-1]["role"] == "user":  # several results in a row: one user turn
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{message['content']}"}
                continue
        out.append(message)
    if not renders_strings:
        out = [{**m, "text": m["content"], "content": [{"type": "text", "text": m["content"]}]} for m in out]
    return out


def tokenize_conversation(tokenizer, messages: list[dict], max_seq_len: int,
                          end_of_turn: frozenset[int] = frozenset()) -> tuple[list[int], list[int], bool] | Dropped:
    """(input_ids, loss_mask, truncated) for one conversation, or why it cannot be used. A token
    of `end_of_turn` right after an assistant text is supervised too: the verifier emits it at the
    end of every answer, and a draft that predicts it gets that token accepted; not after an answer
    marked `unfinished` (regeneration cut it at its token limit: the template closes the turn there,
    the verifier did not)."""
    try:
        messages = for_template(tokenizer, messages)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        located = locate_texts(tokenizer, messages, text)
    except Exception as e:  # a template may raise on any input it dislikes (e.g. roles not alternating)
        return Dropped("template_error", str(e)[:200])
    if isinstance(located, Dropped):
        return located
    spans, contents, finished = located
    if not spans:
        return Dropped("no_supervised_tokens")
    input_ids, offsets = tokenize_rendering(tokenizer, text, contents)
    loss_mask = [0] * len(input_ids)
    span_iter = iter(spans)
    start, end = next(span_iter)
    for i, (a, b) in enumerate(offsets):
        while a >= end:  # spans and tokens are both in text order
            nxt = next(span_iter, None)
            if nxt is None:
                break
            start, end = nxt
        if start <= a and b <= end and a < b:
            loss_mask[i] = 1
    if end_of_turn:
        starts = [a for a, _ in offsets]
        for (_, end), closed_by_verifier in zip(spans, finished, strict=True):
            i = bisect.bisect_left(starts, end)  # the first token after the answer
            if closed_by_verifier and i < len(input_ids) and input_ids[i] in end_of_turn:
                loss_mask[i] = 1
    truncated = len(input_ids) > max_seq_len
    if truncated and not any(loss_mask[:max_seq_len]) and any(loss_mask):
        return Dropped("prompt_exceeds_max_seq_len", f"the first answer starts at token {loss_mask.index(1)}, "
                                                     f"data.max_seq_len is {max_seq_len}")
    input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
    if not any(loss_mask):
        return Dropped("no_supervised_tokens")
    return input_ids, loss_mask, truncated


def locate_texts(tokenizer, messages: list[dict], text: str
                 ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[bool]] | Dropped:
    """Character spans inside the rendered conversation: (the assistant's own texts, every
    message's text as found, whether each assistant text is a finished answer)."""
    spans, contents, finished = [], [], []
    cursor = 0
    for j, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if assistant:
            # The answer begins where generation would: after the conversation so far plus the
            # generation prompt. Templates that rewrite earlier turns later fall back to the cursor.
            prefix = tokenizer.apply_chat_template(messages[:j], tokenize=False, add_generation_prompt=True) if j else ""
            if text.startswith(prefix):
                cursor = max(cursor, len(prefix))
        content = message.get("text", message["content"])
        own = message.get("supervised", content)
        if not content.strip():
            continue
        idx = text.find(content, cursor)
        if idx < 0:  # templates commonly trim
            content, own = content.strip(), own.strip()
            idx = text.find(content, cursor)
        if idx < 0:
            if assistant and own.strip():
                return Dropped("template_alters_assistant_text", f"turn {j} not found verbatim in the rendering")
            continue  # a text the template rewrites does not matter for the mask
        if assistant and own.strip():
            spans.append((idx, idx + len(own)))
            finished.append(not message.get("unfinished"))
        contents.append((idx, idx + len(content)))
        cursor = idx + len(content)
    return spans, contents, finished


def special_token_pattern(tokenizer) -> re.Pattern | None:
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def tokenize_rendering(tokenizer, text: str, contents: list[tuple[int, int]]
                       ) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of a rendered conversation. Where a message's text holds
    a control token's string, the rendering is cut at the control tokens the template placed and
    the pieces between them are tokenized with control-token strings read as text (which is what
    the tokenizer does anyway: it splits at control tokens and encodes the pieces apart)."""
    pattern = special_token_pattern(tokenizer)
    found = list(pattern.finditer(text)) if pattern else []
    inside = [m for m in found if any(a <= m.start() and m.end() <= b for a, b in contents)]
    if not inside:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]
    ids, offsets, position = [], [], 0
    for m in [m for m in found if m not in inside] + [None]:
        end = m.start() if m else len(text)
        if end > position:
            enc = tokenizer(text[position:end], add_special_tokens=False, return_offsets_mapping=True,
                            split_special_tokens=True)
            ids += enc["input_ids"]
            offsets += [(a + position, b + position) for a, b in enc["offset_mapping"]]
        if m:
            ids.append(tokenizer.convert_tokens_to_ids(m.group()))
            offsets.append((m.start(), m.end()))
            position = m.end()
    return ids, offsets
