"""torch.compile's work kept with the run (tasks/train/compile_cache.py): what one process compiled, a
process on a machine with an empty local cache loads instead of compiling. On a CPU the training loop
compiles nothing (speculators compiles the draft on CUDA only), so a small compiled function stands in
for the draft here; each process below has its own, fresh, local inductor cache, as a fresh machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks.train.compile_cache import CompileCache

pytestmark = pytest.mark.system  # compiles the draft twice: `make test` runs it, `make test-fast` does not

ROOT = Path(__file__).resolve().parents[2]

PROCESS = r"""
import json, sys
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from tasks.train.compile_cache import CompileCache

cache = CompileCache(Path(sys.argv[1]), torch.device("cpu"))
loaded = cache.load()
x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
torch.compile(lambda x, w: torch.nn.functional.gelu(x @ w))(x, w).sum().backward()  # forward and backward
written = [str(cache.save()), str(cache.save())]  # once a process: the second call writes nothing
print(json.dumps({"loaded": loaded, "written": written, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def run_process(folder: Path, local_cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(local_cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROCESS, str(folder)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_process_with_an_empty_local_cache_loads_what_another_compiled(tmp_path):
    kept = tmp_path / "train" / ".compile-cache"
    first = run_process(kept, tmp_path / "machine-1")
    assert first["loaded"] == 0 and first["misses"] >= 2 and first["hits"] == 0
    written, again = first["written"]
    assert again == "None"
    (build,) = kept.iterdir()  # one folder per torch build and device
    assert build.name.startswith("torch-") and build.name.endswith("-cpu")
    assert [p.name for p in build.iterdir()] == [Path(written).name]

    second = run_process(kept, tmp_path / "machine-2")
    assert second["loaded"] >= 2 and second["hits"] >= 2 and second["misses"] == 0  # nothing compiled again
    assert second["written"] == ["None", "None"]  # the same set: the file is there already
    assert [p.name for p in build.iterdir()] == [Path(written).name]


def test_a_damaged_cache_file_is_left_and_fails_nothing(tmp_path):
    cache = CompileCache(tmp_path, torch.device("cpu"))
    cache.folder.mkdir(parents=True)
    (cache.folder / "0123456789abcdef.bin").write_bytes(b"not a cache")
    assert cache.load() == 0  # what it held is compiled again
    assert (cache.folder / "0123456789abcdef.bin").is_file()
