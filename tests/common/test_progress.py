"""Progress lines a user reads: rates over the work itself, ETAs that hold still around pauses
(validation, checkpoints), a load that says done only when it is (tasks/common/progress.py)."""

from __future__ import annotations

import pytest

from tasks.common import progress
from tasks.common.progress import LoadMonitor, Progress


def test_validation_pauses_neither_drop_the_rate_nor_swing_the_eta(monkeypatch):
    """A step a second, a 30-s validation every 25 steps: the rate stays a step a second, and from the
    first validation on the ETA falls by the same amount every step, through the later ones too."""
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    run = Progress("train", 200, "step", log_every_s=1e9)
    etas = []
    for step in range(1, 151):
        clock[0] += 1.0
        run.update(1)
        if step % 25 == 0:
            clock[0] += 30.0  # validation and a checkpoint
            run.exclude(30.0)
        if step > 25:
            event = run.event()
            assert event.rate == pytest.approx(1.0)
            etas.append(event.eta_s)
    drops = [a - b for a, b in zip(etas, etas[1:])]
    assert min(drops) > 0 and max(drops) / min(drops) < 1.15, drops  # no swing: steady, and always down
    assert etas[-1] == pytest.approx(50 * (1 + 30 / 25), rel=0.05)  # 50 steps left, a validation per 25


def test_a_wait_before_the_first_unit_is_no_part_of_the_rate(monkeypatch):
    """Streamed training says it waits for its first block (a note, nothing done), then starts at 20
    steps a second: the rate is that from the second step on, not diluted by the wait (an H100 run said
    0.0099 step/s, ETA 159 h, after a 111-s wait and compilation)."""
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    run = Progress("train", 5000, "step", log_every_s=1e9)
    run.update(0, note="waiting for block 1")
    clock[0] += 111.0
    run.update(1)
    assert run.event().rate is None  # one unit: nothing measured yet
    for _ in range(200):
        clock[0] += 0.05
        run.update(1)
    event = run.event()
    assert event.rate == pytest.approx(20.0) and event.eta_s == pytest.approx((5000 - 201) / 20.0)


def test_a_finished_load_says_done_at_its_size():
    with LoadMonitor("weights", 10**9) as monitor:
        pass
    event = monitor.event(1.0, final=True)
    assert event.fraction == 1.0 and "done" in event.note


def test_a_one_off_wait_is_left_out_of_the_eta_and_recurring_waits_are_added_back(monkeypatch):
    """A streamed producer: its window fills in 2 s, it waits 120 s for training to start (compilation:
    a one-off), then makes a block in 0.75 s and waits 1.05 s for training to take the next, 60 times.
    Ten blocks on, the ETA is the time left (1.8 s a block), not 5.6 times it as when the first wait counted
    among the recurring ones (an H100 run's producer said 4 m 52 s with 2 m 27 s left)."""
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    run = Progress("extract (streamed)", 64, "block", log_every_s=1e9)
    for _ in range(4):
        clock[0] += 0.5
        run.update(1)
    clock[0] += 120.0
    run.exclude(120.0, recurs=False)
    for block in range(10):
        clock[0] += 0.75
        run.update(1)
        clock[0] += 1.05
        run.exclude(1.05)
    event = run.event()
    assert event.rate == pytest.approx(1 / 0.75, rel=0.05)
    assert event.eta_s == pytest.approx(50 * 1.8, rel=0.1)
