"""Whether a run trains at all (`retrain.when: drift`): the current draft's simulated acceptance on
this run's new samples against its acceptance on its own validation samples.

    samples.py   which samples are new (by content), the draft's validation samples
    check.py     the measurement, in a worker process (the GPU stays out of the flow's process)
    decision.py  the decision: retrain or not, why, and both figures
"""

from tasks.drift.decision import DriftDecision, measure_drift
from tasks.drift.samples import new_sample_indices, validation_samples

__all__ = ["DriftDecision", "measure_drift", "new_sample_indices", "validation_samples"]
