"""Extraction keyed by sample content: samples already extracted are read from the shards that hold
them, wherever they now fall in source order; only new samples are extracted. Real SmolLM2 on real
ShareGPT samples (the prepared data of tests/extract/test_extract.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from test_extract import SETTINGS, prepared  # noqa: F401  (its prepared data: a fixture)

from tasks.extract.shards import ShardReader
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.dataset import load_prepared
from tasks.train.data import ShardDataset


def selection(prepared, rows: list[int], folder: Path) -> tuple[str, str]:  # noqa: F811
    """A prepared folder holding `rows` of the module's prepared data, in that order: (path, fingerprint)."""
    load_prepared(prepared.path).select(rows).save_to_disk(str(folder / "data"))
    return str(folder), hashlib.sha256(f"{prepared.fingerprint}:{rows}".encode()).hexdigest()


def extract(smollm2, selected: tuple[str, str], out: Path, **settings):
    path, fingerprint = selected
    return run_extraction(ExtractJob(path, fingerprint, smollm2, str(out), settings={**SETTINGS, **settings}),
                          in_process=not settings.get("workers"))


def states_by_id(manifest: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    reader = ShardReader(manifest)
    return {reader.sample_ids[i]: reader[i] for i in range(len(reader))}


def lengths(prepared, rows: list[int]) -> int:  # noqa: F811
    seq_len = load_prepared(prepared.path)["seq_len"]
    return sum(seq_len[r] for r in rows)


@pytest.fixture(scope="module")
def thirds(prepared) -> tuple[list[int], list[int], list[int]]:  # noqa: F811
    """The prepared rows in three parts: new rows, "A" (the first run's rows), more new rows."""
    n = len(load_prepared(prepared.path))
    return list(range(n // 3)), list(range(n // 3, 2 * n // 3)), list(range(2 * n // 3, n))


@pytest.fixture(scope="module")
def runs(prepared, thirds, smollm2, tmp_path_factory):  # noqa: F811
    """Rows A into an empty folder; then new rows, A, more new rows into the same folder (two worker
    processes, each planning for itself); and, for comparison, the new rows alone into an empty one."""
    before, earlier, after = thirds
    root = tmp_path_factory.mktemp("by-content")
    out = root / "hidden_states"
    first = extract(smollm2, selection(prepared, earlier, root / "first"), out)
    mixed_data = selection(prepared, before + earlier + after, root / "mixed")
    mixed = extract(smollm2, mixed_data, out, workers=2)
    fresh = extract(smollm2, selection(prepared, before + after, root / "fresh"), root / "fresh-hs")
    return first, mixed, mixed_data, fresh


def test_only_the_new_samples_are_extracted(runs, thirds, prepared):  # noqa: F811
    first, mixed, _, _ = runs
    before, earlier, after = thirds
    assert (first.samples_extracted, first.samples_reused) == (len(earlier), 0)
    assert (mixed.samples, mixed.samples_extracted, mixed.samples_reused) == (
        len(before + earlier + after), len(before + after), len(earlier))
    assert mixed.tokens_reused == lengths(prepared, earlier) == first.tokens_extracted
    assert mixed.tokens_extracted == lengths(prepared, before + after)
    manifest = json.loads(Path(mixed.manifest).read_text())
    first_shards = {shard["name"] for shard in json.loads(Path(first.manifest).read_text())["shards"]}
    assert first_shards <= {shard["name"] for shard in manifest["shards"]}  # one manifest, two extractions
    assert mixed.shards_extracted == mixed.shards - len(first_shards)


def test_reused_states_are_the_first_runs_byte_for_byte_and_new_ones_a_fresh_extractions(runs):
    first, mixed, _, fresh = runs
    read = states_by_id(mixed.manifest)
    for expected in (states_by_id(first.manifest), states_by_id(fresh.manifest)):
        for sample_id, (ids, states) in expected.items():
            assert torch.equal(read[sample_id][0], ids)
            assert torch.equal(read[sample_id][1].view(torch.int16), states.view(torch.int16)), sample_id
    assert len(read) == mixed.samples


def test_training_reads_the_mixed_manifest(runs, prepared):  # noqa: F811
    _, mixed, (mixed_path, _), _ = runs
    dataset = ShardDataset(mixed.manifest, mixed_path)
    data = load_prepared(mixed_path)
    row_of = {sample_id: r for r, sample_id in enumerate(data["sample_id"])}
    reader = ShardReader(mixed.manifest)
    assert sorted(reader.sample_ids) == sorted(data["sample_id"]) and len(dataset) == len(data)
    for i in range(len(dataset)):
        item = dataset[i]
        row = data[row_of[reader.sample_ids[i]]]
        assert item["input_ids"].tolist() == row["input_ids"]
        assert item["loss_mask"].tolist() == [bool(m) for m in row["loss_mask"]]
        assert item["hidden_states"].shape == (len(row["input_ids"]), 3 * 576)
    assert reader.sample_keys == [key for shard in reader.manifest["shards"] for key in shard["sample_keys"]]


def test_a_run_of_some_earlier_samples_in_another_order_extracts_nothing(runs, prepared, smollm2,  # noqa: F811
                                                                          tmp_path):
    """Samples taken from the middle of shards, out of order: read through their positions in the shards."""
    _, mixed, _, _ = runs
    n = mixed.samples
    rows = [n - 3, n // 2, 3, n // 2 + 2, n - 2]
    result = extract(smollm2, selection(prepared, rows, tmp_path), Path(mixed.manifest).parent)
    assert (result.samples_extracted, result.samples_reused, result.verifier_loaded) == (0, len(rows), False)
    manifest = json.loads(Path(result.manifest).read_text())
    assert any("positions" in shard for shard in manifest["shards"])
    expected = states_by_id(mixed.manifest)
    read = states_by_id(result.manifest)
    assert set(read) == {load_prepared(prepared.path)["sample_id"][r] for r in rows}
    for sample_id, (ids, states) in read.items():
        assert torch.equal(ids, expected[sample_id][0]) and torch.equal(states, expected[sample_id][1])


def test_a_rerun_after_new_shards_were_lost_extracts_only_them_again(runs, smollm2, tmp_path):
    """The mixed run's new shards deleted: the same command again extracts those samples alone, into the
    same files (the plan that wrote them is recognized), and still reads A from the first run's shards."""
    import shutil

    first, mixed, mixed_data, _ = runs
    out = tmp_path / "hidden_states"
    shutil.copytree(Path(mixed.manifest).parent, out)
    first_shards = {shard["name"] for shard in json.loads(Path(first.manifest).read_text())["shards"]}
    new_shards = sorted(shard["name"] for shard in json.loads(Path(mixed.manifest).read_text())["shards"]
                        if shard["name"] not in first_shards)
    before = {name: (out / name).read_bytes() for name in new_shards}
    for name in new_shards[::2]:
        (out / name).unlink()
    again = extract(smollm2, mixed_data, out)
    assert again.shards_extracted == len(new_shards[::2])
    assert again.samples_reused + again.samples_extracted == mixed.samples
    assert 0 < again.samples_extracted < mixed.samples_extracted
    assert {name: (out / name).read_bytes() for name in new_shards} == before
    assert json.loads(Path(again.manifest).read_text()) == json.loads(Path(mixed.manifest).read_text())


def test_shards_of_the_older_format_are_found_by_their_planned_name(runs, thirds, prepared, smollm2,  # noqa: F811
                                                                    tmp_path):
    """Shards written before content keys (no `sample_keys` in their metadata) serve the rows they were
    planned for, as before: the first run's shards rewritten so, the same data again extracts nothing."""
    from tasks.extract.shards import load_shard, write_safetensors

    first, _, _, _ = runs
    out = tmp_path / "hidden_states"
    out.mkdir()
    for shard in json.loads(Path(first.manifest).read_text())["shards"]:
        tensors, metadata = load_shard(Path(first.manifest).parent / shard["name"])
        older = {k: v for k, v in metadata.items() if k not in ("sample_keys", "plan")}
        with (out / shard["name"]).open("wb") as f:
            write_safetensors(f, tensors, older)
    # no journal: each shard is verified in full, then used by its name
    earlier = thirds[1]
    again = extract(smollm2, selection(prepared, earlier, tmp_path / "data"), out)
    assert (again.samples_extracted, again.samples_reused, again.verifier_loaded) == (0, len(earlier), False)
    listed = json.loads(Path(again.manifest).read_text())["shards"]
    assert [s["name"] for s in listed] == [s["name"] for s in json.loads(Path(first.manifest).read_text())["shards"]]
    assert all(len(s["sample_keys"]) == len(s["sample_ids"]) for s in listed)
