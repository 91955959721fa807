"""data.sources beyond JSON: Parquet, Arrow (as `datasets` writes it) and CSV files, and a Hub dataset
read from a real huggingface_hub cache laid out on disk (offline), each prepared as the same rows in
JSON Lines are: real ShareGPT rows, tool calls with content parts, bad rows dropped and counted."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.prepare.chat_data import Dropped, read_rows
from tasks.prepare.dataset import load_prepared, read_report
from tasks.prepare.stage import prepare
from tests.hub_cache import lay_out_repo, offline_env
from tests.prepare.test_prepare import TOOL_USE, masked_runs

ROOT = Path(__file__).resolve().parents[2]
# TOOL_USE with every content as OpenAI's content parts: a Parquet or Arrow column holds one type
TOOL_USE_PARTS = [{**m, "content": None if m["content"] is None else
                   m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]}
                  for m in TOOL_USE]


def write_table(path: Path, rows: list[dict]) -> Path:
    """`rows` as a Parquet file, an Arrow file `datasets` wrote (save_to_disk), or a CSV file whose
    conversation cells are JSON text."""
    from datasets import Dataset

    if path.suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix == ".arrow":
        Dataset.from_list(rows).save_to_disk(str(path.parent / "saved"))
        (arrow,) = (path.parent / "saved").glob("*.arrow")
        arrow.rename(path)
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: v if isinstance(v, str) or v is None else json.dumps(v) for k, v in row.items()}
                             for row in rows)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prepared_alike(smollm2, tmp_path, source, reference: Path, max_seq_len: int = 512) -> dict:
    """prepare of `source` and of the reference JSON Lines file: the same samples; the report."""
    got = prepare(smollm2, [source], tmp_path / "out", max_seq_len=max_seq_len)
    want = prepare(smollm2, [str(reference)], tmp_path / "reference", max_seq_len=max_seq_len)
    a, b = load_prepared(got.path), load_prepared(want.path)
    assert len(a) == len(b) > 0
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    report, expected = read_report(got.path), read_report(want.path)
    for key in ("rows_read", "rows_kept", "dropped", "unknown_roles", "tokens", "supervised_tokens"):
        assert report[key] == expected[key], key
    return report


FORMATS = ["parquet", "arrow", "csv"]


@pytest.mark.parametrize("suffix", FORMATS)
def test_real_sharegpt_rows_prepare_as_from_json(smollm2, sharegpt, tmp_path, suffix):
    rows = [row.data for row in read_rows([sharegpt], 30) if not isinstance(row.data, Dropped)]
    rows = [{"conversations": [{"from": t["from"], "value": t["value"]} for t in r["conversations"]]} for r in rows]
    source = write_table(tmp_path / f"sharegpt.{suffix}", rows)
    report = prepared_alike(smollm2, tmp_path, str(source), write_jsonl(tmp_path / "sharegpt.jsonl", rows))
    assert report["rows_read"] == len(rows)


@pytest.mark.parametrize("suffix", FORMATS)
def test_tool_calls_and_content_parts_keep_their_context_and_supervise_the_answer(smollm2, tokenizer, tmp_path,
                                                                                    suffix):
    rows = [{"messages": TOOL_USE_PARTS}] * 2
    source = write_table(tmp_path / f"tools.{suffix}", rows)
    prepared_alike(smollm2, tmp_path, str(source), write_jsonl(tmp_path / "tools.jsonl", rows))
    sample = load_prepared(prepare(smollm2, [str(source)], tmp_path / "out", max_seq_len=512).path)[0]
    rendered = tokenizer.decode(sample["input_ids"])
    assert "get_weather" in rendered and "18C and sunny" in rendered
    answer = TOOL_USE[-1]["content"][0]["text"]
    assert [tokenizer.decode(run) for run in masked_runs(sample["input_ids"], sample["loss_mask"])] == [answer]


def turns(*pairs) -> list[dict]:
    return [{"from": who, "value": what} for who, what in pairs]


# conversation cells a typed column holds (ShareGPT turns), each unusable but the first
CELLS = [
    turns(("human", "What is 2+2?"), ("gpt", "It is 4.")),
    turns(("alien", "hi"), ("gpt", "hello")),
    [{"from": None, "value": "no role"}, {"from": "gpt", "value": "hello"}],
    turns(("human", "   "), ("gpt", "hello")),
    turns(("human", "only a question")),
    None,
    turns(("human", "word " * 400), ("gpt", "ok")),
]
# what only text cells hold (CSV): broken JSON, a list where a turn's text goes, a lone surrogate
TEXT_CELLS = ["{not json", json.dumps(turns(("human", ["a", "list"]), ("gpt", "hello"))),
              '[{"from": "human", "value": "a lone \\ud800 surrogate"}, {"from": "gpt", "value": "hi"}]']


@pytest.mark.parametrize("suffix", FORMATS)
def test_each_bad_row_is_dropped_and_counted_by_reason(smollm2, tmp_path, suffix):
    rows = [{"id": str(i), "conversations": cell} for i, cell in enumerate(CELLS)]
    reference = [{"id": r["id"], **({"conversations": r["conversations"]} if r["conversations"] else {})}
                 for r in rows]
    if suffix == "csv":
        rows += [{"id": "text", "conversations": cell} for cell in TEXT_CELLS]
        reference += [cell if cell.startswith("{") else {"id": "text", "conversations": json.loads(cell)}
                      for cell in TEXT_CELLS]
    source = write_table(tmp_path / f"bad.{suffix}", rows)
    report = prepared_alike(smollm2, tmp_path, str(source), write_jsonl(tmp_path / "bad.jsonl", reference), 128)
    assert report["rows_kept"] == 1 and report["unknown_roles"] == {"alien": 1}
    assert set(report["dropped"]) == {"unknown_role", "missing_role", "empty_content", "no_assistant_turn",
                                      "not_a_conversation", "prompt_exceeds_max_seq_len"} | (
        {"invalid_json", "non_string_content", "invalid_text"} if suffix == "csv" else set())
    assert report["dropped_examples"]["unknown_role"] == [f"bad.{suffix}:1"]


def test_prompt_and_response_columns_are_a_conversation(smollm2, tmp_path):
    from tasks.common.config import DataSource

    rows = [{"question": "What is 2+2?", "answer": "It is 4."}, {"question": "Name a color.", "answer": "Blue."},
            {"question": "No answer yet", "answer": None}]
    source = DataSource(dataset=str(write_table(tmp_path / "qa.csv", rows)), prompt="question", response="answer")
    reference = [{"messages": [{"role": "user", "content": r["question"]}]
                  + ([{"role": "assistant", "content": r["answer"]}] if r["answer"] else [])} for r in rows]
    report = prepared_alike(smollm2, tmp_path, source, write_jsonl(tmp_path / "qa.jsonl", reference))
    assert (report["rows_kept"], report["dropped"]) == (2, {"no_assistant_turn": 1})


HUB_README = """---
configs:
- config_name: sharegpt
  data_files:
  - split: train
    path: data/sharegpt-train.parquet
- config_name: qa
  data_files:
  - split: train
    path: data/qa-train.parquet
  - split: test
    path: data/qa-test.parquet
---
"""
PREPARE_FROM_CONFIG = """
import json, sys
from tasks.common.config import PipelineConfig
from tasks.common.demo_assets import resolve_config
from tasks.preflight import check_data
from tasks.prepare.stage import prepare, sources_fingerprint
config = resolve_config(PipelineConfig.model_validate(json.loads(sys.argv[1])), weights=False)
check_data(config)
result = prepare(config.verifier.path, config.data.sources, config.output_dir, max_seq_len=512)
print(json.dumps({"prepared": result.path, "sources_fingerprint": sources_fingerprint(config.data.sources),
                  "sources": [s if isinstance(s, str) else s.model_dump() for s in config.data.sources]}))
"""


def parquet_bytes(tmp_path: Path, rows: list[dict]) -> bytes:
    return write_table(tmp_path / "rows.parquet", rows).read_bytes()


def prepare_offline(hf_home: Path, smollm2: str, out: Path, sources: list) -> subprocess.CompletedProcess:
    config = {"name": "hub-data", "output_dir": str(out), "verifier": {"path": smollm2}, "data": {"sources": sources}}
    return subprocess.run([sys.executable, "-c", PREPARE_FROM_CONFIG, json.dumps(config)], capture_output=True,
                          text=True, cwd=ROOT, env=offline_env(hf_home), timeout=600)


def test_a_hub_dataset_is_read_from_the_cache_by_subset_split_and_columns(smollm2, sharegpt, tmp_path):
    rows = [row.data for row in read_rows([sharegpt], 12) if not isinstance(row.data, Dropped)]
    rows = [{"conversations": [{"from": t["from"], "value": t["value"]} for t in r["conversations"]]} for r in rows]
    qa = [{"question": "What is 2+2?", "answer": "It is 4."}, {"question": "Name a color.", "answer": "Blue."}]
    hub = tmp_path / "hf" / "hub"
    files = {"README.md": HUB_README.encode(), "data/sharegpt-train.parquet": parquet_bytes(tmp_path, rows),
             "data/qa-train.parquet": parquet_bytes(tmp_path, qa), "data/qa-test.parquet": parquet_bytes(tmp_path, qa[:1])}
    snapshot = lay_out_repo(hub, "dataset", "org/chats", files)
    plain = lay_out_repo(hub, "dataset", "org/sharegpt-slice",
                         {"data/train-00000-of-00001.parquet": files["data/sharegpt-train.parquet"]})
    sources = ["org/sharegpt-slice", {"dataset": "org/chats", "subset": "sharegpt", "messages": "conversations"},
               {"dataset": "org/chats", "subset": "qa", "split": "test", "prompt": "question", "response": "answer"}]
    done = prepare_offline(tmp_path / "hf", smollm2, tmp_path / "out", sources)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert [s if isinstance(s, str) else s["dataset"] for s in result["sources"]] == [str(plain), *[str(snapshot)] * 2]
    reference = rows + rows + [{"messages": [{"role": "user", "content": qa[0]["question"]},
                                             {"role": "assistant", "content": qa[0]["answer"]}]}]
    want = prepare(smollm2, [str(write_jsonl(tmp_path / "reference.jsonl", reference))], tmp_path / "ref",
                   max_seq_len=512)
    got, expected = load_prepared(result["prepared"]), load_prepared(want.path)
    assert got["input_ids"] == expected["input_ids"] and got["loss_mask"] == expected["loss_mask"]
    assert got["sample_id"][0] == "org/sharegpt-slice/train:0" and got["sample_id"][-1] == "org/chats/qa/test:0"

    # a new commit of the same id is other data, though its files are the same
    lay_out_repo(hub, "dataset", "org/sharegpt-slice",
                 {"data/train-00000-of-00001.parquet": files["data/sharegpt-train.parquet"]}, ref="main-2")
    (hub / "datasets--org--sharegpt-slice" / "refs" / "main").write_text(
        (hub / "datasets--org--sharegpt-slice" / "refs" / "main-2").read_text())
    again = prepare_offline(tmp_path / "hf", smollm2, tmp_path / "out", sources)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["sources_fingerprint"] != result["sources_fingerprint"]


@pytest.mark.parametrize("source, message", [
    ({"dataset": "org/chats", "subset": "qa", "split": "validation"}, "Bad split: validation"),
    ({"dataset": "org/chats", "subset": "qa", "prompt": "prompt"}, "has no column prompt (its columns: question"),
    ("org/not-downloaded", "Hub dataset org/not-downloaded is not in the Hugging Face cache"),
])
def test_a_split_column_or_dataset_that_is_not_there_is_named_before_any_work(smollm2, tmp_path, source, message):
    qa = [{"question": "What is 2+2?", "answer": "It is 4."}]
    lay_out_repo(tmp_path / "hf" / "hub", "dataset", "org/chats",
                 {"README.md": HUB_README.encode(), "data/qa-train.parquet": parquet_bytes(tmp_path, qa),
                  "data/qa-test.parquet": parquet_bytes(tmp_path, qa), "data/sharegpt-train.parquet": b""})
    done = prepare_offline(tmp_path / "hf", smollm2, tmp_path / "out", [source])
    assert done.returncode != 0 and message in done.stderr.strip().splitlines()[-1], done.stderr
    assert "PreflightError" in done.stderr or "HubRepoNotFound" in done.stderr
    assert not (tmp_path / "out").exists()
