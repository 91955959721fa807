"""prepare on the real SmolLM2 tokenizer and real ShareGPT rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.prepare.chat_data import Dropped, normalize, read_rows
from tasks.prepare.chat_template import tokenize_conversation
from tasks.prepare.dataset import load_prepared, read_report
from tasks.prepare.stage import PrepareError, end_of_turn_ids, prepare


def masked_runs(input_ids, loss_mask):
    runs, current = [], []
    for token, supervised in zip(input_ids, loss_mask):
        if supervised:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def real_conversations(sharegpt, n):
    out = []
    for row in read_rows([sharegpt], n):
        if isinstance(row.data, Dropped):
            continue
        messages = normalize(row.data)
        if not isinstance(messages, Dropped):
            out.append((row.row_id, messages))
    return out


def test_masked_tokens_decode_to_exactly_the_assistant_texts(tokenizer, sharegpt):
    conversations = real_conversations(sharegpt, 400)
    multi_turn = 0
    for row_id, messages in conversations:
        tokenized = tokenize_conversation(tokenizer, messages, max_seq_len=10**9)
        assert not isinstance(tokenized, Dropped), (row_id, tokenized)
        input_ids, loss_mask, truncated = tokenized
        assert not truncated
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        decoded = [tokenizer.decode(run) for run in masked_runs(input_ids, loss_mask)]
        assert decoded == answers, row_id
        multi_turn += len(answers) > 1
    assert multi_turn > 50  # the check covered real multi-turn conversations


def test_end_of_turn_supervision_adds_exactly_the_token_closing_each_answer(tokenizer, smollm2, sharegpt):
    end_of_turn = end_of_turn_ids(smollm2, tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in end_of_turn  # SmolLM2's ChatML end of turn
    for row_id, messages in real_conversations(sharegpt, 100):
        ids, plain, _ = tokenize_conversation(tokenizer, messages, max_seq_len=10**9)
        same_ids, with_eot, _ = tokenize_conversation(tokenizer, messages, 10**9, end_of_turn)
        assert same_ids == ids
        added = [i for i, (a, b) in enumerate(zip(plain, with_eot)) if a != b]
        assert all(plain[i] == 0 and with_eot[i] == 1 and ids[i] in end_of_turn for i in added), row_id
        assert all(plain[i - 1] == 1 for i in added)  # right after an answer's last token
        assert len(added) == sum(m["role"] == "assistant" for m in messages), row_id  # one per answer


def test_template_tokens_are_never_supervised(tokenizer, sharegpt):
    special = set(tokenizer.all_special_ids)
    for _, messages in real_conversations(sharegpt, 50):
        input_ids, loss_mask, _ = tokenize_conversation(tokenizer, messages, max_seq_len=10**9)
        assert not any(m and t in special for t, m in zip(input_ids, loss_mask))
        # the rendered input is exactly what the template produces
        assert input_ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]


def test_truncation_keeps_a_prefix_and_counts_rows(tokenizer, sharegpt, tmp_path):
    max_len = 64
    result = prepare(tokenizer.name_or_path, [sharegpt], tmp_path, max_seq_len=max_len, max_rows=60)
    data = load_prepared(result.path)
    report = read_report(result.path)
    assert max(data["seq_len"]) <= max_len
    assert report["truncated_rows"] > 0
    conversations = dict(real_conversations(sharegpt, 60))
    for row in data:
        full_ids, full_mask, _ = tokenize_conversation(tokenizer, conversations[row["sample_id"]], 10**9)
        assert row["input_ids"] == full_ids[:max_len]
        assert row["loss_mask"] == full_mask[:max_len]
        assert row["seq_len"] == len(row["input_ids"])
    # rows whose prompt alone fills the window have nothing to learn from and are dropped, named
    assert report["dropped"].get("prompt_exceeds_max_seq_len", 0) > 0


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


GOOD = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "It is 4."}]}


def test_each_bad_row_reason_is_counted_and_nothing_crashes(smollm2, tmp_path):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]}
    rows = [
        GOOD,
        "{not json",
        {"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"value": "no role"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": ["a", "list"]}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "no conversation at all"},
        long_prompt,
        ["not", "a", "dict"],
        {"conversations": [{"from": "human", "value": "a lone \ud800 surrogate"}, {"from": "gpt", "value": "hi"}]},
    ]
    source = write_lines(tmp_path / "bad.jsonl", rows)
    result = prepare(smollm2, [str(source)], tmp_path / "out", max_seq_len=128)
    report = read_report(result.path)
    assert report["rows_read"] == len(rows)
    assert report["rows_kept"] == 1
    assert report["dropped"] == {
        "invalid_json": 1,
        "unknown_role": 1,
        "missing_role": 1,
        "empty_content": 1,
        "non_string_content": 1,
        "no_assistant_turn": 1,
        "not_a_conversation": 2,
        "prompt_exceeds_max_seq_len": 1,  # the usual cause of no supervised token, named
        "invalid_text": 1,  # JSON carries "\ud800"; no tokenizer takes it
    }
    assert report["dropped_examples"]["invalid_json"] == ["bad.jsonl:1"]
    assert report["unknown_roles"] == {"alien": 1}  # which role, by name


def test_truncated_json_array_keeps_every_complete_row(smollm2, tmp_path):
    text = json.dumps([GOOD, GOOD, GOOD], indent=1)
    source = tmp_path / "cut.json"
    source.write_text(text[: len(text) - 40])  # the last element is cut in half, as in the PyPI ShareGPT slice
    report = read_report(prepare(smollm2, [str(source)], tmp_path / "out", max_seq_len=128).path)
    assert (report["rows_kept"], report["dropped"]) == (2, {"invalid_json": 1})


def test_json_lines_end_at_newline_alone_so_unicode_line_separators_stay_inside_their_row(tmp_path):
    """U+2028, U+2029 and U+0085 may stand unescaped in a JSON string (writers with ensure_ascii off
    leave them): a row is one line up to "\n", CRLF line ends included."""
    said = "First line\u2028second line\u2029third\x85fourth"
    rows = [{"conversations": [{"from": "human", "value": said}, {"from": "gpt", "value": f"Answer {i}."}]}
            for i in range(3)]
    source = tmp_path / "separators.jsonl"
    source.write_bytes("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode() + b"\n\n")
    read = list(read_rows([str(source)]))
    assert [r.row_id for r in read] == ["separators.jsonl:0", "separators.jsonl:1", "separators.jsonl:2"]
    assert [r.data for r in read] == rows


def test_formats_agree_sharegpt_openai_jsonl_and_datasets_folder(smollm2, sharegpt, tmp_path):
    from datasets import Dataset

    raw = [row.data for row in read_rows([sharegpt], 30) if not isinstance(row.data, Dropped)]
    as_openai = [
        {"messages": [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
                      for t in r["conversations"]]}
        for r in raw
    ]
    (tmp_path / "sharegpt.json").write_text(json.dumps(raw))
    write_lines(tmp_path / "openai.jsonl", as_openai)
    Dataset.from_list(as_openai).save_to_disk(str(tmp_path / "hf"))
    outputs = []
    for name, src in [("a", "sharegpt.json"), ("b", "openai.jsonl"), ("c", "hf")]:
        result = prepare(smollm2, [str(tmp_path / src)], tmp_path / name, max_seq_len=512)
        outputs.append(load_prepared(result.path))
    assert outputs[0]["input_ids"] == outputs[1]["input_ids"] == outputs[2]["input_ids"]
    assert outputs[0]["loss_mask"] == outputs[1]["loss_mask"] == outputs[2]["loss_mask"]


def test_output_is_deterministic_and_keyed_by_content(smollm2, sharegpt, tmp_path):
    source = tmp_path / "data.json"
    shutil.copy(sharegpt, source)
    first = prepare(smollm2, [str(source)], tmp_path / "a", max_seq_len=256, max_rows=40)
    second = prepare(smollm2, [str(source)], tmp_path / "b", max_seq_len=256, max_rows=40)
    assert first.fingerprint == second.fingerprint
    a, b = load_prepared(first.path), load_prepared(second.path)
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"] and a["sample_id"] == b["sample_id"]

    with source.open("r+b") as f:  # edit one character of the first conversation
        head = f.read(200)
        f.seek(head.index(b"Summarize"))
        f.write(b"summarize")
    edited = prepare(smollm2, [str(source)], tmp_path / "a", max_seq_len=256, max_rows=40)
    assert edited.fingerprint != first.fingerprint
    assert Path(first.path).is_dir()  # the earlier result is kept, not overwritten
    assert prepare(smollm2, [str(source)], tmp_path / "a", max_seq_len=128, max_rows=40).fingerprint != edited.fingerprint


def test_a_pool_of_tokenizing_processes_writes_what_one_process_writes(smollm2, sharegpt, tmp_path, monkeypatch,
                                                                        caplog):
    """Rows go to the worker processes in chunks (of 30 here, 1,000 in a run): the samples, their
    order, the drops and the report are one process's, across chunk boundaries and the last partial
    chunk."""
    from tasks.prepare import samples

    monkeypatch.setattr(samples, "CHUNK_ROWS", 30)
    one = prepare(smollm2, [sharegpt], tmp_path / "one", max_seq_len=256, max_rows=125, workers=1)
    with caplog.at_level("INFO", logger="tasks.prepare.samples"):
        pool = prepare(smollm2, [sharegpt], tmp_path / "pool", max_seq_len=256, max_rows=125, workers=2)
    assert "tokenizing in 2 processes, chunks of 30 rows" in caplog.text
    a, b = load_prepared(one.path), load_prepared(pool.path)
    assert a.features == b.features and len(a) == one.rows == pool.rows > 60
    for column in a.column_names:
        assert a[column] == b[column], column
    report_one, report_pool = read_report(one.path), read_report(pool.path)
    del report_one["wall_s"], report_pool["wall_s"]
    assert report_one == report_pool and report_one["rows_read"] == 125 and report_one["dropped"]


def test_missing_verifier_and_missing_template_fail_before_any_work(smollm2, sharegpt, tmp_path):
    with pytest.raises(PrepareError, match="verifier folder not found"):
        prepare(str(tmp_path / "nope"), [sharegpt], tmp_path / "out", max_seq_len=128)
    no_template = tmp_path / "no-template"
    shutil.copytree(smollm2, no_template, ignore=shutil.ignore_patterns("*.safetensors"))
    (no_template / "chat_template.jinja").unlink()
    with pytest.raises(PrepareError, match="no chat template"):
        prepare(str(no_template), [sharegpt], tmp_path / "out", max_seq_len=128)
    assert not (tmp_path / "out").exists()


def test_missing_data_source_is_named(smollm2, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        prepare(smollm2, [str(tmp_path / "missing.jsonl")], tmp_path / "out", max_seq_len=128)


WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
TOOL_USE = [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": "How is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is 18C and sunny in Paris."}]},
]
# ChatML with tool calls and results, as Qwen2.5's template renders them
TOOL_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>{{ call.function.name }}({{ call.function.arguments | tojson }})"
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# a template that knows three roles and raises on any other
STRICT_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{%- endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.mark.parametrize("template", ["smollm2", "tool-aware", "strict"])
def test_tool_use_is_kept_as_context_and_only_the_assistant_text_is_supervised(tokenizer, template):
    import copy

    from tasks.prepare.chat_data import read_conversation

    if template != "smollm2":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = TOOL_TEMPLATE if template == "tool-aware" else STRICT_TEMPLATE
    conversation = read_conversation({"messages": TOOL_USE})
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "tool", "assistant"]
    input_ids, loss_mask, _ = tokenize_conversation(tokenizer, conversation.messages, max_seq_len=10**9)
    rendered = tokenizer.decode(input_ids)
    assert "get_weather" in rendered and "Paris" in rendered and "18C and sunny" in rendered  # all the context
    assert [tokenizer.decode(run) for run in masked_runs(input_ids, loss_mask)] == ["It is 18C and sunny in Paris."]
    if template == "tool-aware":  # the template's own rendering of the call and the result
        assert 'get_weather({"city": "Paris"})' in rendered and "<tool_response>18C and sunny" in rendered


def test_an_empty_turn_keeps_the_exchanges_before_it_and_is_counted(smollm2, tmp_path):
    exchanges = [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello, how can I help?"},
                 {"from": "human", "value": "Name a color."}, {"from": "gpt", "value": "Blue."}]
    rows = [{"conversations": [*exchanges, {"from": "human", "value": "And another?"}, {"from": "gpt", "value": ""},
                               {"from": "human", "value": "Thanks"}, {"from": "gpt", "value": "You're welcome."}]},
            {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "Hello."}]}]
    source = write_lines(tmp_path / "empty-turns.jsonl", rows)
    result = prepare(smollm2, [str(source)], tmp_path / "out", max_seq_len=512)
    report = read_report(result.path)
    assert (report["rows_kept"], report["dropped"]) == (1, {"empty_content": 1})
    assert (report["shortened_rows"], report["turns_cut"]) == (1, 4)  # the empty exchange and the one after it
    assert report["shortened_examples"] == ["empty-turns.jsonl:0"]
    from transformers import AutoTokenizer

    row = load_prepared(result.path)[0]
    answers = [AutoTokenizer.from_pretrained(smollm2).decode(run)
               for run in masked_runs(row["input_ids"], row["loss_mask"])]
    assert answers == ["Hello, how can I help?", "Blue."]


def test_control_token_strings_inside_messages_are_tokenized_as_text(tokenizer):
    messages = [{"role": "user", "content": "What does <|im_end|> mean in ChatML?"},
                {"role": "assistant", "content": "It closes a turn, as in <|im_start|>user\nhi<|im_end|>."}]
    input_ids, loss_mask, _ = tokenize_conversation(tokenizer, messages, max_seq_len=10**9)
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    turns = 3  # the template's default system turn, the question, the answer
    assert input_ids.count(start) == turns and input_ids.count(end) == turns  # only those the template placed
    assert [tokenizer.decode(run) for run in masked_runs(input_ids, loss_mask)] == [messages[1]["content"]]
    special = set(tokenizer.all_special_ids)
    assert not any(m and t in special for t, m in zip(input_ids, loss_mask, strict=True))
    plain = [{"role": m["role"], "content": m["content"].replace("<|im_", "<im_")} for m in messages]
    assert tokenize_conversation(tokenizer, plain, 10**9)[0] == tokenizer.apply_chat_template(plain)["input_ids"]


