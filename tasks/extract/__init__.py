"""Stage 2, extract: the verifier's hidden states at 3 auxiliary layers plus the last.

    plan.py: shards, bytes, time, disk and memory checked before any model loads
    -> stage.py: the verifier loaded only if a shard is missing, worker processes
    -> writer.py: batches through a backend (backends/: transformers, vLLM), shards written
    -> stage.py: every shard verified, the manifest written

Hands on: `hidden_states/` of fingerprinted, checksummed shards (format and readers: shards.py;
fp8 storage: storage_dtype.py) and the manifest that lists them. tasks/plan.py sizes a whole run
the same way from config files alone (`eagle3-pipeline plan`).
"""
