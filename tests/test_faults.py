"""A few trials of each fault kind of bench/faults.py (the full suite is that benchmark): random kills of
real stage processes, damaged extraction folders, full disks and two runs on one folder, each
ending identical to an uninterrupted run."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "faults.py"


@pytest.fixture(scope="module")
def faults():
    spec = importlib.util.spec_from_file_location("faults", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["faults"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inputs(faults, smollm2, sharegpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    faults.ATIME_WORKS = faults.atime_tracks_reads(work)
    return faults.Inputs(work)


def assert_all_held(trials) -> None:
    assert trials
    for trial in trials:
        assert trial.ok and trial.identical, trial
        assert trial.temporaries_read in (0, None), trial


# Training's kill and resume runs in tests/test_train.py (across epochs, and the metrics log across a
# checkpoint); the flow's only in the benchmark (minutes per trial).
@pytest.mark.parametrize("kind", ["kill-extract-2", "kill-regenerate"])
def test_random_kills_of_the_stage_process_group_end_identical(faults, inputs, kind):
    trials = faults.kill_trials(inputs, kind, 1, random.Random(17))
    assert_all_held(trials)
    assert trials[0].redone == 0  # no finished shard or written conversation is done again


def test_damaged_extraction_folders_are_refused_by_training_and_repaired(faults, inputs):
    cases = ["garbage appended to a shard", "journal line not an object", "truncated manifest"]
    trials = faults.damage_trials(inputs, cases)
    assert sorted(t.fault for t in trials) == sorted(cases)
    assert_all_held(trials)


def test_disk_too_small_or_filled_during_the_run(faults, inputs):
    trials = faults.disk_trials(inputs)
    if "cannot mount" in trials[0].note:
        pytest.skip(trials[0].note)
    assert [t.fault.split(" ")[0] for t in trials] == ["plan", "another"]
    assert_all_held(trials)  # refused before loading / a clear error; nothing partial; the re-run identical


def test_two_runs_on_one_folder(faults, inputs):
    assert_all_held(faults.concurrent_trials(inputs, 1, kinds=("extract-2",)))
