"""The extraction plan of a large run on 1, 4 and 16 nodes, from the pipeline's own plan code.

    python bench/cluster_plan.py                       # Kimi-K2.5-class: hidden 7168, 61 layers, 547 GB
    python bench/cluster_plan.py --conversations 100000 --tokens 2048 --nodes 1 4 16

The shards come from `tasks.extract.plan.plan_shards` on stand-in rows of the given length (only
their lengths shape the plan), the bytes and host buffers from `ExtractionPlan`, as the extract
stage prints them. One rank per node (vLLM TP=8 over the node's 8 GPUs); shard i goes to rank
i % nodes. The time of a node is its tokens over the slower of two rates, both given on the command
line and printed: the verifier's forward (`--node-tokens-per-s`) and the disk write of the states
(`--node-write-gb-s`); with a shared filesystem, the nodes' writes together are bounded by its
aggregate bandwidth (`--fs-write-gb-s`).

Both modes side by side (docs/STREAMING.md): offline keeps every shard on disk and runs the verifier
once; streamed (extract.mode 'stream') holds at most `--stream-window` shards plus the validation
shards (`--val-fraction` of them, held out whole) and runs the verifier once per epoch (`--epochs`),
while the draft trains: the same rates, `--epochs` times the extraction, no disk to rent for it.

Training's steady-state time comes from `tasks.train.sizing` (the rate measured for an 8B-shaped
draft, scaled by this verifier's draft arithmetic), on every GPU of the nodes (offline: after the
extraction) and on one node's 8 (streamed on Ray: one node trains while the others produce).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.common.config import TrainSettings  # noqa: E402
from tasks.common.progress import format_seconds  # noqa: E402
from tasks.common.verifier import read_config, text_config  # noqa: E402
from tasks.extract.plan import ExtractionPlan, plan_shards  # noqa: E402
from tasks.plan import H100_BF16_TFLOPS  # noqa: E402
from tasks.train.sizing import size_training  # noqa: E402

GPUS_PER_NODE = 8


class Rows:
    """What plan_shards reads from a prepared dataset, for `n` rows of `length` tokens: the columns, and
    the token rows as Arrow batches (tasks.prepare.dataset.token_rows), made a batch at a time."""

    def __init__(self, n: int, length: int):
        self.n, self.length = n, length

    def __getitem__(self, key):
        return {"seq_len": [self.length] * self.n, "sample_id": [f"c{i}" for i in range(self.n)]}[key]

    def with_format(self, _):
        return self

    def iter(self, batch_size: int):
        for first in range(0, self.n, batch_size):
            rows = min(batch_size, self.n - first)
            offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * self.length)
            values = pa.array(np.tile(np.arange(self.length, dtype=np.int32), rows))
            yield pa.table({"input_ids": pa.ListArray.from_arrays(offsets, values)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=100_000)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per conversation")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--shard-tokens", type=int, default=131072, help="extract.shard_tokens (large-verifier.yaml)")
    p.add_argument("--storage-dtype", choices=["bf16", "fp8_e4m3"], default="bf16", help="extract.storage_dtype")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--node-tokens-per-s", type=float, default=52_000,
                   help="one node's extraction rate, compute bound (default: derived in docs/SCALE.md)")
    p.add_argument("--node-write-gb-s", type=float, default=1.16, help="one node's write rate (measured: H200 node)")
    p.add_argument("--fs-write-gb-s", type=float, default=None, help="the shared filesystem's aggregate write rate")
    p.add_argument("--epochs", type=int, default=3, help="train.epochs: verifier passes when streamed")
    p.add_argument("--stream-window", type=int, default=16, help="extract.stream_window, shards")
    p.add_argument("--val-fraction", type=float, default=0.005, help="train.val_fraction: shards held out whole")
    p.add_argument("--verifier", type=Path, default=Path(__file__).resolve().parents[1] / "deployments" / "verifiers"
                   / "kimi-k2.5", help="a folder with the verifier's config.json: the draft's shape")
    p.add_argument("--draft-vocab", type=int, default=32000, help="vocab.draft_vocab_size")
    a = p.parse_args()
    shape, _ = text_config(read_config(a.verifier))

    def training_s(tokens: int, gpus: int) -> float:
        train = TrainSettings(epochs=a.epochs, val_fraction=a.val_fraction, nproc=gpus)
        return size_training(shape, train, a.draft_vocab, tokens, H100_BF16_TFLOPS, H100_BF16_TFLOPS).seconds

    shards = plan_shards(Rows(a.conversations, a.tokens), "plan", a.shard_tokens)
    tokens = sum(s.tokens for s in shards)
    plan = ExtractionPlan("plan", "Kimi-K2.5-class", "-", [2, 30, 58, 61], a.hidden, a.conversations, tokens, shards,
                          storage_dtype=a.storage_dtype)
    summary = plan.summary()
    per_token = plan.bytes_per_token
    rows = []
    for nodes in a.nodes:
        mine = shards[0::nodes]  # rank 0 holds the most shards
        node_tokens = sum(s.tokens for s in mine)
        write_rate = a.node_write_gb_s * 1e9
        if a.fs_write_gb_s:
            write_rate = min(write_rate, a.fs_write_gb_s * 1e9 / nodes)
        rate = min(a.node_tokens_per_s, write_rate / per_token)
        rows.append({"nodes": nodes, "shards_per_node": len(mine), "tokens_per_node": node_tokens,
                     "disk_written_per_node_tb": round(node_tokens * per_token / 1e12, 2),
                     "host_buffers_gb_per_node": summary["host_buffers_gb_per_worker"],
                     "node_tokens_per_s": round(rate), "bound": "compute" if rate == a.node_tokens_per_s else "disk",
                     "expected_time": format_seconds(math.ceil(node_tokens / rate)),
                     "streamed_extraction_time": format_seconds(math.ceil(a.epochs * node_tokens / rate)),
                     "training_time_all_gpus": format_seconds(training_s(tokens, GPUS_PER_NODE * nodes)),
                     "training_time_one_node": format_seconds(training_s(tokens, GPUS_PER_NODE))})
    held_out = math.ceil(a.val_fraction * len(shards))
    stream_shards = min(len(shards), a.stream_window + held_out)  # per node: each producer rank its own share
    print(plan.describe().splitlines()[0])
    print(json.dumps({"plan": {k: summary[k] for k in ("samples", "tokens", "shards", "bytes_total_gb",
                                                      "host_buffers_gb_per_worker")},
                      "shard_gb": round(shards[0].tokens * per_token / 1e9, 2), "bytes_per_token": per_token,
                      "rates": {"node_tokens_per_s": a.node_tokens_per_s, "node_write_gb_s": a.node_write_gb_s,
                                "fs_write_gb_s": a.fs_write_gb_s},
                      "nodes": rows,
                      "stream": {"disk_peak_gb": round(stream_shards * shards[0].tokens * per_token / 1e9, 1),
                                 "window_shards": a.stream_window, "validation_shards": held_out,
                                 "verifier_passes": a.epochs}}, indent=1))


if __name__ == "__main__":
    main()
