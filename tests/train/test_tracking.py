"""The training log across a kill and resume: metrics.jsonl trimmed, TensorBoard's view purged."""

from __future__ import annotations

import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tasks.train.tracking import TrainingLog, read_metrics


def test_a_resumed_log_hides_what_the_killed_process_wrote_past_its_checkpoint(tmp_path):
    killed = TrainingLog(tmp_path, start_step=0)
    for step in range(1, 7):  # checkpoint at step 4, killed after logging step 6 (never closed)
        killed.write({"split": "train", "step": step, "loss": 10.0 - step, "lr": 1e-3})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"split": "train", "st')  # the kill cut the next record off
    # TensorBoard reads event files in name order: the second they were created in, then (one process, one
    # second) a process-wide counter compared as text, "9" after "10". A resumed run is a new process, a
    # later second: so here too
    time.sleep(1.1)
    resumed = TrainingLog(tmp_path, start_step=4)
    for step in range(5, 9):  # the resumed process redoes 5 and 6, with other values
        resumed.write({"split": "train", "step": step, "loss": 100.0 + step, "lr": 1e-3})
    resumed.close()

    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == \
        [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    board = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert set(board.Tags()["scalars"]) == {"train/loss", "train/lr"}
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == \
        [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]


def test_tensorboard_can_be_turned_off(tmp_path):
    log = TrainingLog(tmp_path, start_step=0, tensorboard=False)
    log.write({"split": "val", "step": 1, "loss": 2.0})
    log.close()
    assert read_metrics(tmp_path) == [{"split": "val", "step": 1, "loss": 2.0}]
    assert not (tmp_path / "tensorboard").exists()
