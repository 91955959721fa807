"""Shared fixtures: the real demo model and data (built once per machine, see tasks/demo_assets.py)."""

from __future__ import annotations

import pytest

from tasks.demo_assets import ensure_asset


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
    from tasks.prepare import load_tokenizer

    return load_tokenizer(smollm2)
