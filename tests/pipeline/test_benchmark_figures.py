"""docs/benchmarks.json holds current figures only, each with its date, command and hardware, and a
bench's `--record` replaces an entry without losing the one it replaces (bench/record.py)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import record as recorder

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_figure_says_when_how_and_where_it_was_measured():
    figures = json.loads((DOCS / "benchmarks.json").read_text())
    assert figures
    for name, entry in figures.items():
        missing = [k for k in ("value", "date", "command", "hardware") if not entry.get(k)]
        assert not missing, f"{name} lacks {missing}"
    for line in (DOCS / "benchmarks-history.jsonl").read_text().splitlines():
        assert json.loads(line)["figure"]


def test_recording_replaces_the_entry_and_moves_the_old_one_to_the_history(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "CURRENT", tmp_path / "benchmarks.json")
    monkeypatch.setattr(recorder, "HISTORY", tmp_path / "benchmarks-history.jsonl")
    recorder.CURRENT.write_text(json.dumps({"speed": {"value": 1.0, "goal": 1.3, "date": "2026-01-01", "command": "x",
                                                      "hardware": "y"}, "other": {"value": 2}}))
    recorder.record({"speed": {"value": 1.2, "unit": "ratio"}}, command="python bench/speed.py")
    current = json.loads(recorder.CURRENT.read_text())
    assert current["other"] == {"value": 2}
    assert current["speed"]["value"] == 1.2 and current["speed"]["goal"] == 1.3  # the goal carries over
    assert current["speed"]["command"] == "python bench/speed.py" and current["speed"]["hardware"].startswith("CPU")
    (old,) = [json.loads(line) for line in recorder.HISTORY.read_text().splitlines()]
    assert old == {"figure": "speed", "value": 1.0, "goal": 1.3, "date": "2026-01-01", "command": "x", "hardware": "y"}
