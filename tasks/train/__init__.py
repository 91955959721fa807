"""Stage 4, train: an EAGLE-3 draft with speculators' model, losses and checkpoint format.

    data.py: inputs checked together -> stage.py: one process, or torchrun, or Ray Train (on_ray.py)
    -> loop.py: the training loop (data.py: shards into packed steps; model.py: speculators' draft
    and optimizers; evaluation.py and acceptance.py: validation and acceptance metrics;
    checkpoints.py; tracking.py: metrics.jsonl and TensorBoard; step_profile.py)

Hands on: `train/<fingerprint>/draft/`, the best checkpoint by simulated acceptance length in the
layout vLLM loads, and a `TrainResult`.
"""
