"""`eagle3-pipeline gc OUTPUT_DIR`: what no kept run references is removed, and the bytes are said.

Two runs in one output folder, each with real prepared data, a real extraction (SmolLM2: the second
reads the samples it shares with the first from the first's shards) and a real vocabulary; their
training and validation folders are folders of files (gc reads none of them)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from flows.cli import main
from tasks.common.folder_lock import folder_lock
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.dataset import load_prepared
from tasks.prepare.stage import prepare
from tasks.vocab import build_vocab

SETTINGS = {"batch_tokens": 2048, "shard_tokens": 300}  # a shard or two per sample


def one_run(out: Path, smollm2: str, name: str, rows: list[int], full) -> list[str]:
    """A run on `rows` of the prepared data `full`: its outputs under `out`, and its record's references."""
    prepared = out / "prepared" / name
    load_prepared(full.path).select(rows).save_to_disk(str(prepared / "data"))
    fingerprint = hashlib.sha256(f"{full.fingerprint}:{rows}".encode()).hexdigest()
    extracted = run_extraction(ExtractJob(str(prepared), fingerprint, smollm2, str(out / "hidden_states"),
                                          settings=SETTINGS), in_process=True)
    vocab = build_vocab(str(prepared), fingerprint, smollm2, out, draft_vocab_size=256)
    references = [str(prepared), extracted.manifest, str(vocab.path)]
    for stage in ("train", "validation"):
        folder = out / stage / f"{name}-{stage}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(os.urandom(4096))
        references.append(str(folder))
    return references


@pytest.fixture(scope="module")
def two_runs_made(smollm2, sharegpt, tmp_path_factory) -> Path:
    """The first run on rows 0-5, the second on rows 3-9: the first's shards of rows 0-2 only serve it."""
    out = tmp_path_factory.mktemp("gc") / "out"
    full = prepare(smollm2, [sharegpt], out, max_seq_len=256, max_rows=12)  # out/prepared/<fp>: no run's
    assert full.rows >= 10
    (out / "runs").mkdir()
    for number, rows in enumerate([list(range(6)), list(range(3, 10))], 1):
        record = out / "runs" / f"run-{number}.json"
        record.write_text(json.dumps({"references": one_run(out, smollm2, f"run{number}", rows, full)}))
    return out


@pytest.fixture
def two_runs(two_runs_made, tmp_path) -> Path:
    """A copy of the two runs' output folder for one test, its records naming the copy's paths."""
    out = tmp_path / "out"
    shutil.copytree(two_runs_made, out)
    for number in (1, 2):
        record = out / "runs" / f"run-{number}.json"
        record.write_text(record.read_text().replace(str(two_runs_made), str(out)))
        os.utime(record, ns=(number * 10**9, number * 10**9))  # the second is the newer
    return out


def files_under(out: Path) -> dict[Path, int]:
    return {Path(folder) / name: os.lstat(Path(folder) / name).st_size
            for folder, _, names in os.walk(out) for name in names}


def test_gc_keeps_the_newest_run_and_removes_the_others_outputs(two_runs, capsys):
    out = two_runs
    first, second = (json.loads((out / "runs" / f"run-{n}.json").read_text())["references"] for n in (1, 2))
    manifest = {n: json.loads(Path(refs[1]).read_text()) for n, refs in ((1, first), (2, second))}
    second_shards = {shard["name"] for shard in manifest[2]["shards"]}
    shared = {shard["name"] for shard in manifest[1]["shards"]} & second_shards
    only_first = {shard["name"] for shard in manifest[1]["shards"]} - second_shards
    assert shared and only_first  # the second run reads some of the first's shards, not all
    before = files_under(out)
    gone_expected = {path for path in before if any(path == Path(ref) or Path(ref) in path.parents for ref in first)
                     and path.name not in shared}
    gone_expected |= {out / "hidden_states" / name for name in only_first}
    gone_expected |= {path for path in before if (out / "prepared") in path.parents
                      and not any(Path(ref) in path.parents for ref in first + second)}  # the full prepared data

    assert main(["gc", str(out), "--keep-runs", "1", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert set(files_under(out)) >= set(before)  # nothing removed (gc's lock file added)
    summary = f"{len(gone_expected)} files, {sum(before[p] for p in gone_expected):,} bytes"
    assert f"would remove {summary}" in dry

    assert main(["gc", str(out), "--keep-runs", "1"]) == 0
    report = capsys.readouterr().out
    after = files_under(out)
    assert set(before) - set(after) == gone_expected
    assert f"removed {summary}" in report
    assert all(Path(ref).exists() for ref in second)  # the kept run's outputs, and the shards its manifest lists
    assert all((out / "hidden_states" / name).is_file() for name in second_shards)
    assert (out / "runs" / "run-1.json").is_file()  # records, journals and locks are never touched
    assert (out / "hidden_states" / "journal").is_dir()

    assert main(["gc", str(out), "--keep-runs", "1"]) == 0  # nothing left to remove
    assert "removed 0 files, 0 bytes" in capsys.readouterr().out and files_under(out) == after


def test_gc_keeps_what_a_registry_version_references(two_runs, capsys):
    out = two_runs
    first = json.loads((out / "runs" / "run-1.json").read_text())["references"]
    lineage = out / "registry" / "draft" / "versions" / "1" / "lineage.json"
    lineage.parent.mkdir(parents=True)
    lineage.write_text(json.dumps({"references": first}))
    before = files_under(out)
    assert main(["gc", str(out), "--keep-runs", "1"]) == 0
    assert all(Path(ref).exists() for ref in first)
    manifest = json.loads(Path(first[1]).read_text())
    assert all((out / "hidden_states" / shard["name"]).is_file() for shard in manifest["shards"])
    removed = set(before) - set(files_under(out))
    assert removed and all((out / "prepared") in path.parents for path in removed)  # only the full prepared data
    assert f"removed {len(removed)} files" in capsys.readouterr().out


def test_gc_without_a_run_record_or_on_a_busy_folder_removes_nothing(two_runs, capsys):
    out = two_runs
    before = files_under(out)
    train = next((out / "train").iterdir())
    with folder_lock(train, "training"):
        assert main(["gc", str(out), "--keep-runs", "1"]) == 3
    assert f"{train.name} is in use by another eagle3-pipeline run" in capsys.readouterr().err
    for record in (out / "runs").iterdir():
        record.unlink()
    after_records = files_under(out)
    assert main(["gc", str(out)]) == 2
    assert "no run record" in capsys.readouterr().err
    assert files_under(out) == after_records and set(before) - set(after_records) == {
        out / "runs" / "run-1.json", out / "runs" / "run-2.json"}
