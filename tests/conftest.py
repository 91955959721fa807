"""Shared fixtures: the real demo model and data (built once per machine, see tasks/common/demo_assets.py),
and what more than one stage's tests use."""

from __future__ import annotations

import os

import pytest

from tasks.common.demo_assets import ensure_asset


def pytest_configure(config):
    """Under pytest-xdist (`make test`, `make test-fast`: TEST_WORKERS processes), each worker runs on its own
    share of the machine's cores, as on a machine of its own: unpinned, two workers' torch and vLLM threads
    wait at every barrier for a core the other holds (2026-12-07, 2 cores, `make test-fast`'s 223 tests: 570 s
    in one process, 898 s in two unpinned, 459 s in two pinned). Its children (trainings, engines) inherit it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker and count > 1:
        cores = sorted(os.sched_getaffinity(0))
        share = set(cores[int(worker.removeprefix("gw")) % count::count]) or set(cores)  # fewer cores than workers: all
        os.sched_setaffinity(0, share)
        os.environ.setdefault("OMP_NUM_THREADS", str(len(share)))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects the system tests counted here
def pytest_collection_modifyitems(config, items):
    """The modules with the most system tests (20 s or more each) first: pytest-xdist hands whole modules
    to its workers in this order (`--dist loadfile --no-loadscope-reorder`), and a long module handed out
    last would run alone at the end while the other worker idles. Without xdist, the same order."""
    system_tests: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        system_tests[module] = system_tests.get(module, 0) + bool(item.get_closest_marker("system"))
    items.sort(key=lambda item: -system_tests[item.nodeid.split("::")[0]])  # stable: each module's order kept


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect test server for the session's in-process flow runs (its start migrates a new database:
    10-14 s on 2 cores, paid once instead of once per module)."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def smollm2() -> str:
    return str(ensure_asset("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def sharegpt() -> str:
    return str(ensure_asset("sharegpt"))


@pytest.fixture(scope="session")
def mtbench() -> str:
    return str(ensure_asset("mt-bench"))


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    from tasks.prepare.stage import load_tokenizer

    return load_tokenizer(smollm2)


@pytest.fixture(scope="session")
def vllm_prepared(smollm2, sharegpt, tmp_path_factory):
    from tasks.prepare.stage import prepare

    return prepare(smollm2, [sharegpt], tmp_path_factory.mktemp("vllm-prep"), max_seq_len=256, max_rows=24)


@pytest.fixture(scope="session")
def vllm_extractions(vllm_prepared, smollm2, tmp_path_factory):
    """The same samples extracted by vLLM and by transformers: compared in tests/extract; the vLLM
    states train the draft that tests/validate serves."""
    from tasks.extract.stage import ExtractJob, run_extraction

    root = tmp_path_factory.mktemp("vllm-hs")
    settings = {"batch_tokens": 2048, "shard_tokens": 3000}
    prepared = vllm_prepared
    return {backend: run_extraction(ExtractJob(prepared.path, prepared.fingerprint, smollm2, str(root / backend),
                                               settings={**settings, "backend": backend}), in_process=True)
            for backend in ("vllm", "transformers")}
