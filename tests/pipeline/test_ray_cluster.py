"""The `ray` executor on a real local Ray cluster of two worker nodes (ray.cluster_utils.Cluster): a
custom resource `accel` stands in for each node's GPU, one CPU per node; real SmolLM2, real
ShareGPT, a real Prefect API, real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from flow_support import small_config, task_states, untimed, write_sample_data
from safetensors.torch import load_file

from tasks.common.errors import is_deterministic
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.dataset import read_report
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.train.tracking import read_metrics

pytestmark = pytest.mark.system  # a 2-node local Ray cluster: `make test` runs it, `make test-fast` does not
# Every node of the local cluster on the loopback address (by default Ray advertises the machine's
# first interface): read by Ray when it is imported, here and in the processes its nodes start.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ACCEL = "accel"


@pytest.fixture(scope="module")
def cluster():
    """A head (the flow's node: no accelerator) and two worker nodes with one `accel` each."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1, resources={ACCEL: 1}) for _ in range(2)]
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def workspace(sharegpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    return root, write_sample_data(sharegpt, root / "chats.jsonl", 14)


def ray_config(out: Path, data: Path, cluster, /, *, ray: dict | None = None, **sections):
    """The test's small config on the local cluster (`ray`: more cluster settings)."""
    return small_config(out, data, cluster={"executor": "ray", "address": cluster.address, "accelerator": ACCEL,
                                            **(ray or {})}, **sections)


def first_stages_flow(extract: bool = True):
    """The pipeline's prepare and (with `extract`) extract stages, as the pipeline runs them: their cache in
    the output folder (flows/task_support.py `result_storage`), not in Prefect's default ~/.prefect/storage,
    where it outlived the folder: a later session's test folder at the same path found a cache hit there."""
    from prefect import flow

    from flows.ray_stages import cluster_for_run
    from flows.stages import extract_task, prepare_task
    from flows.task_support import result_storage
    from tasks.common.demo_assets import resolve_config

    @flow(name="first-stages")
    def first_stages(config):
        config = resolve_config(config)
        storage = result_storage(config)
        prepare, extract_stage = (t.with_options(result_storage=storage) for t in (prepare_task, extract_task))
        with cluster_for_run(config):
            prepared = prepare(config)
            return (prepared, extract_stage(config, prepared)) if extract else prepared

    return first_stages


def run_flow(flow, config):
    state = flow(config, return_state=True)
    assert state.is_completed(), state
    return state.result(), task_states(state.state_details.flow_run_id), state.state_details.flow_run_id


@contextmanager
def threads_of_a_rank():
    """This process computing with one thread, as a rank does: Ray starts a task that asks for one
    CPU with OMP_NUM_THREADS=1, and on CPUs with AMX, bf16 matmuls round differently for other
    thread counts (the same bytes need the same thread count there; on GPUs it plays no part)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.safetensors"))}


TRAIN = {"epochs": 2, "grad_accum_steps": 2, "log_every": 1}


@pytest.fixture(scope="module")
def ray_run(prefect_api, cluster, workspace):
    """The whole pipeline on the cluster: extraction by 2 ranks, one per node, and training across
    the 2 nodes (one process each, one micro-batch each per step: the global batch of 2)."""
    from flows.pipeline import eagle3_pipeline

    root, data = workspace
    config = ray_config(root / "out", data, cluster[0], train=TRAIN, ray={"train_nodes": 2})
    result, states, _ = run_flow(eagle3_pipeline, config)
    return config, result, states


def test_two_ranks_on_two_nodes_write_the_shards_one_local_process_writes(ray_run, workspace, smollm2):
    root, _ = workspace
    config, result, states = ray_run
    prepared, extracted = result["prepared"], result["extracted"]
    assert states["extract rank 0 of 2"] == states["extract rank 1 of 2"] == ("Completed", 1)
    assert states["extract"][0] == "Completed" and extracted.verifier_loaded
    assert extracted.shards_extracted == extracted.shards >= 2
    out = Path(extracted.manifest).parent
    with threads_of_a_rank():
        reference = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(root / "local"),
                                              settings=config.extract.model_dump()), in_process=True)
    assert reference.fingerprint == extracted.fingerprint
    assert shard_bytes(out) == shard_bytes(root / "local")  # byte for byte, so every checksum is equal
    writers = {json.loads(line)["name"]: p.name for p in (out / "journal").glob("*.jsonl")
               for line in p.read_text().splitlines()}
    assert len(set(writers.values())) == 2  # written by two processes


def test_training_across_two_nodes_follows_one_process_over_the_same_global_batch(ray_run, workspace, smollm2):
    root, _ = workspace
    config, result, states = ray_run
    prepared, extracted, vocab, trained = result["prepared"], result["extracted"], result["vocab"], result["trained"]
    assert states["train"] == ("Completed", 1)
    local = run_training(TrainJob(extracted.manifest, prepared.path, vocab.path, smollm2, str(root / "train-local"),
                                  extracted.layers[:3], settings=config.train.model_dump()),
                         extracted.fingerprint, vocab.fingerprint, in_process=True)
    assert trained.fingerprint == local.fingerprint  # the same run, whatever the node count: one cache key
    on_ray, alone = read_metrics(Path(trained.draft_path).parent), read_metrics(root / "train-local")
    assert [(m["split"], m["step"]) for m in on_ray] == [(m["split"], m["step"]) for m in alone] and len(alone) >= 4
    for a, b in zip(on_ray, alone, strict=True):
        if a["split"] == "train":  # DDP's gradient all-reduce against one process's accumulation: float32 sums
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), a["step"]
        else:  # validation split over the 2 ranks: token-counted accuracies agree
            assert a["simulated_acceptance_length"] == pytest.approx(b["simulated_acceptance_length"], abs=1e-3)
    assert trained.steps == local.steps and trained.best_step == local.best_step


def test_the_same_run_on_the_local_executor_is_all_cached(ray_run, workspace):
    """The cache keys do not depend on the executor, the number of ranks and nodes, nor on settings
    that only change how the outputs are made."""
    from flows.pipeline import eagle3_pipeline

    root, data = workspace
    config, _, _ = ray_run
    how = {"workers": 2, "verify": "quick", "reserve_disk_gb": 0.5, "batch_tokens": 2048}
    assert all(getattr(config.extract, k) != v for k, v in how.items())
    local = small_config(root / "out", data, train={**TRAIN, "loader_workers": 1, "log_every": 3}, extract=how)
    assert local.cluster.executor == "local" and config.cluster.executor == "ray"
    _, states, _ = run_flow(eagle3_pipeline, local)
    assert {name: state for name, (state, _) in states.items()} == {
        stage: "Cached" for stage in ("prepare", "extract", "vocab", "train", "validate")}


def test_regeneration_by_two_ranks_writes_the_conversations_one_local_run_writes(prefect_api, cluster, workspace):
    from tasks.common.demo_assets import resolve_config
    from tasks.prepare.regenerate import regenerate, regeneration_job

    root, data = workspace
    regeneration = {"max_rows": 6, "regenerate": {"enabled": True, "backend": "transformers", "max_new_tokens": 12,
                                                  "max_turns": 1, "chunk_size": 2}}
    config = ray_config(root / "regen", data, cluster[0], data=regeneration)
    prepared, states, _ = run_flow(first_stages_flow(extract=False), config)
    assert states["regenerate rank 0 of 2"] == states["regenerate rank 1 of 2"] == ("Completed", 1)
    job = regeneration_job(resolve_config(config))
    out = Path(job.out_dir)
    # the answers are stored by content, written by two processes: chunks 0, 2 and chunk 1
    assert len(list((job.store / "parts").glob("*.jsonl"))) == 2
    report = json.loads((out / "report.json").read_text())
    assert [r["conversations"] for r in report["ranks"]] == [4, 2] and report["backend"] == "transformers"
    # a local run with an answer store of its own (an empty store_dir: its out_dir), answering everything again
    local = regenerate(replace(job, out_dir=str(root / "regen-local"), store_dir=""), in_process=True)
    assert (out / "conversations.jsonl").read_bytes() == local.read_bytes()
    assert read_report(prepared.path)["rows_read"] == report["regenerated"] > 0  # prepare read them
    # the same prepare on the local executor, in other chunks and batches: a cache hit
    made_otherwise = {**regeneration, "regenerate": {**regeneration["regenerate"], "chunk_size": 4, "batch_size": 3}}
    _, local_states, _ = run_flow(first_stages_flow(extract=False), small_config(root / "regen", data,
                                                                                 data=made_otherwise))
    assert {name: state for name, (state, _) in local_states.items()} == {"prepare": "Cached"}


def test_a_stream_produced_on_one_node_trains_on_the_other_as_a_local_offline_run(prefect_api, cluster, workspace,
                                                                                   sharegpt, smollm2):
    """extract.mode stream on the cluster: training takes one node's accelerator, so the one producer rank
    runs on the other node, writing blocks of shards into the shared folder while Ray Train reads them;
    the draft is the one a local offline run trains, tensor for tensor, and the window is never exceeded."""
    from flows.pipeline import eagle3_pipeline

    ray_cluster, workers = cluster
    root, _ = workspace
    data = write_sample_data(sharegpt, root / "stream-chats.jsonl", 40)
    window, train = 4, {**TRAIN, "shuffle_block_shards": 2}
    config = ray_config(root / "stream", data, ray_cluster, train=train,
                        extract={"shard_tokens": 300, "mode": "stream", "stream_window": window})
    result, states, flow_run_id = run_flow(eagle3_pipeline, config)
    prepared, extracted, vocab, trained = result["prepared"], result["extracted"], result["vocab"], result["trained"]
    assert extracted.streamed and states["train"] == ("Completed", 1)
    assert states["extract (streamed) rank 0 of 1"] == ("Completed", 1)
    assert rank_nodes(flow_run_id)[0][0] in {node.node_id[:12] for node in workers}
    shard_dir = Path(extracted.manifest).parent
    report, kept = trained.stream, len(json.loads((shard_dir / "stream" / "sequence.json").read_text())["pinned"])
    assert report["shards_produced"] > extracted.shards > window + kept and report["shards_deleted"] > 0  # 2 epochs
    assert 0 < report["high_water_bytes"] <= (window + kept) * report["largest_shard_bytes"]
    assert not list(shard_dir.glob("shard-*"))  # nothing left once training ended
    with threads_of_a_rank():  # the Ray Train process's thread count
        offline = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(root / "stream-local"),
                                            settings={**config.extract.model_dump(), "mode": "offline"}),
                                 in_process=True)
        local = run_training(TrainJob(offline.manifest, prepared.path, vocab.path, smollm2,
                                      str(root / "stream-train-local"), offline.layers[:3],
                                      settings=config.train.model_dump()),
                             offline.fingerprint, vocab.fingerprint, in_process=True)
    assert local.fingerprint == trained.fingerprint  # one cache key, streamed or not
    assert untimed(read_metrics(Path(trained.draft_path).parent)) == untimed(read_metrics(root / "stream-train-local"))
    streamed_draft, local_draft = (load_file(Path(d) / "model.safetensors") for d in (trained.draft_path,
                                                                                       local.draft_path))
    assert streamed_draft.keys() == local_draft.keys()
    assert all(torch.equal(streamed_draft[k], local_draft[k]) for k in local_draft)


def test_streaming_needs_accelerators_for_training_and_a_producer_at_once(cluster):
    """Producer ranks take what training leaves; a cluster that cannot hold both at once is refused (a
    trainer would wait for a producer Ray never places), naming what it advertises."""
    import ray

    from flows.ray_stages import ClusterError, producer_ranks
    from tasks.common.config import ClusterSettings

    if not ray.is_initialized():
        ray.init(address=cluster[0].address)
    settings = ClusterSettings(executor="ray", accelerator=ACCEL)
    assert producer_ranks(settings, 1, 1) == 1
    for ranks, training in ((None, 2), (2, 1)):  # training takes both; two producers beside training
        with pytest.raises(ClusterError, match=f"the cluster advertises 2 '{ACCEL}'") as refused:
            producer_ranks(settings.model_copy(update={"ranks": ranks}), 1, training)
        assert is_deterministic(refused.value)


def node_running(workers, pid: int):
    """The cluster node whose raylet started the Ray worker that is `pid`'s parent."""
    raylet_of = {node.all_processes["raylet"][0].process.pid: node for node in workers}
    for parent in psutil.Process(pid).parents():
        if parent.pid in raylet_of:
            return raylet_of[parent.pid]
    return None


def test_a_rank_whose_node_is_lost_runs_again_on_the_other_node(prefect_api, cluster, workspace, sharegpt, smollm2):
    ray_cluster, workers = cluster
    root, _ = workspace
    data = write_sample_data(sharegpt, root / "more-chats.jsonl", 40)
    config = ray_config(root / "lost", data, ray_cluster, extract={"shard_tokens": 300})
    journal = root / "lost" / "hidden_states" / "journal"
    lost: dict = {}

    def remove_a_node_after_its_rank_wrote_a_shard():
        """Once a rank's worker process has written some but not all of its 3 shards (its journal
        file is named after its pid), the node running it goes away."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not lost:
            for p in psutil.process_iter(["cmdline"]):
                cmd = " ".join(p.info["cmdline"] or [])
                own_journal = journal / f"{socket.gethostname()}-{p.pid}.jsonl"
                if "tasks.extract.stage" in cmd and "--rank" in cmd and own_journal.is_file():
                    node = node_running(workers, p.pid)
                    if 0 < len(own_journal.read_text().splitlines()) < 3 and node is not None:
                        lost.update(node=node, pid=p.pid)
                        ray_cluster.remove_node(node)
                        break
            time.sleep(0.05)

    watcher = threading.Thread(target=remove_a_node_after_its_rank_wrote_a_shard, daemon=True)
    watcher.start()
    try:
        (prepared, extracted), states, flow_run_id = run_flow(first_stages_flow(), config)
    finally:
        watcher.join(timeout=5)
        if lost:  # the cluster as the other tests found it: two worker nodes
            workers.remove(lost["node"])
            workers.append(ray_cluster.add_node(num_cpus=1, resources={ACCEL: 1}))
    assert lost, "the ranks finished before a node could be removed"
    assert not psutil.pid_exists(lost["pid"])  # the rank's worker process went with its node
    assert states["extract"] == ("Completed", 1) and extracted.shards == 6  # the stage itself never failed
    assert states["extract rank 0 of 2"][0] == states["extract rank 1 of 2"][0] == "Completed"
    started_on = rank_nodes(flow_run_id)
    lost_node = lost["node"].node_id[:12]
    lost_rank = next(rank for rank, nodes in started_on.items() if nodes[0] == lost_node)
    assert len(started_on[lost_rank]) == 2 and started_on[lost_rank][1] != lost_node  # again, on the other node
    journal = [json.loads(line)["name"] for f in (root / "lost" / "hidden_states" / "journal").glob("*.jsonl")
               for line in f.read_text().splitlines()]
    assert sorted(journal) == sorted(set(journal)) and len(journal) == extracted.shards  # none written twice
    with threads_of_a_rank():
        run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(root / "lost-local"),
                                  settings=config.extract.model_dump()), in_process=True)
    assert shard_bytes(Path(extracted.manifest).parent) == shard_bytes(root / "lost-local")


def rank_nodes(flow_run_id) -> dict[int, list[str]]:
    """{rank: the nodes (id prefixes) its task started on, in order}, from the flow run's logs in the
    Prefect API ('rank R of N on node ID (host)')."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC)
    out: dict[int, list[str]] = {}
    for m in logs:
        if m.message.startswith("rank ") and " on node " in m.message:
            out.setdefault(int(m.message.split()[1]), []).append(m.message.split(" on node ")[1].split()[0])
    return out


@contextmanager
def node_not_seeing(folder: Path, gcs_address: str):
    """A third node whose processes see an empty folder at `folder` (a tmpfs mounted over it in a mount
    namespace of their own): a node where the shared filesystem is not mounted."""
    script = Path(__file__).resolve().parents[1] / "ray_node.py"
    log = (folder.parent / "blind-node.log").open("wb")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f'mount -t tmpfs tmpfs "{folder}" && exec "{sys.executable}" "{script}" "{gcs_address}"'],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def test_a_node_that_does_not_see_the_output_folder_stops_the_run_before_any_stage(prefect_api, cluster, workspace):
    from flows.ray_stages import ClusterError

    ray_cluster, _ = cluster
    root, data = workspace
    out = root / "blind"
    out.mkdir()
    with node_not_seeing(out, ray_cluster.address) as node:
        deadline = time.monotonic() + 300  # a node joins in seconds, in minutes on a loaded machine
        while sum(n["Alive"] for n in ray_cluster.global_state.node_table()) < 4:
            assert node.poll() is None and time.monotonic() < deadline, (root / "blind-node.log").read_text()
            time.sleep(0.5)
        state = first_stages_flow()(ray_config(out, data, ray_cluster), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, ClusterError) and is_deterministic(error)
    assert f"1 of 4 Ray nodes do not see the output folder {out}" in str(error) and "no such file" in str(error)
    assert list(out.iterdir()) == []  # no stage ran, and the marker is gone
