"""A few trials of bench/faults.py (the full suite is that benchmark): a random kill of real extraction
processes, a damaged extraction folder, full disks, each ending identical to an uninterrupted run."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "faults.py"
pytestmark = pytest.mark.system  # random kill trials: `make test` runs them, `make test-fast` does not


@pytest.fixture(scope="module")
def faults():
    spec = importlib.util.spec_from_file_location("faults", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["faults"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inputs(faults, smollm2, sharegpt, tmp_path_factory):
    return faults.Inputs(tmp_path_factory.mktemp("faults"))


def assert_all_held(trials) -> None:
    assert trials
    for trial in trials:
        assert trial.ok and trial.identical, trial
        assert trial.temporaries_read in (0, None), trial


# The CI subset: a few seconds to a minute each. Training's kill and resume runs in tests/train/test_train.py (across
# epochs, and the metrics log across a checkpoint), a part-recorded regeneration chunk in tests/prepare/test_regenerate.py,
# the other damage cases in tests/extract/test_extract.py and tests/train/test_train.py, the folder lock in tests/extract/test_extract.py;
# the flow's kills, two runs at once and 20 of each only in the benchmark.
def test_a_random_kill_of_two_extraction_workers_ends_identical(faults, inputs):
    trials = faults.kill_trials(inputs, "kill-extract-2", 1, random.Random(17))
    assert_all_held(trials)
    assert trials[0].redone == 0  # no finished shard is done again


def test_a_damaged_shard_is_refused_by_training_and_only_it_is_redone(faults, inputs):
    trials = faults.damage_trials(inputs, ["garbage appended to a shard"])
    assert [t.fault for t in trials] == ["garbage appended to a shard"]
    assert_all_held(trials)  # training named the file; extraction redid that one shard, identical


def test_disk_too_small_or_filled_during_the_run(faults, inputs):
    trials = faults.disk_trials(inputs)
    if "cannot mount" in trials[0].note:
        pytest.skip(trials[0].note)
    assert [t.fault.split(" ")[0] for t in trials] == ["plan", "another"]
    assert_all_held(trials)  # refused before loading / a clear error; nothing partial; the re-run identical

