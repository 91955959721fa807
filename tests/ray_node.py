"""A Ray worker node joining a running cluster, in this process's namespaces, until SIGTERM: what
`ray start --address=...` does, for a test that starts a node which sees another filesystem.

    python tests/ray_node.py GCS_ADDRESS

(`ray start` itself cannot join a cluster on the loopback address: it resolves 127.0.0.1 to the
machine's first interface.)
"""

from __future__ import annotations

import signal
import sys
import time

from ray._private.node import Node
from ray._private.parameter import RayParams


def main(gcs_address: str) -> None:
    params = RayParams(gcs_address=gcs_address, node_ip_address="127.0.0.1", num_cpus=1, num_gpus=0,
                       object_store_memory=150 * 1024 * 1024, include_log_monitor=False, node_manager_port=0,
                       min_worker_port=0, max_worker_port=0)
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"node {node.node_id} joined {gcs_address}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1])
