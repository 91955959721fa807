"""The code's shape, read from its imports: each stage's cache key holds the source of every module
it runs, no module imports itself through others, and a stage's modules load only what they need."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

import flows.retraining
import flows.stages

ROOT = Path(__file__).resolve().parents[2]
MODULE_NAME = re.compile(r"(tasks|flows)(\.\w+)+")


def module_names() -> list[str]:
    """Every module under tasks/ and flows/ (packages by their __init__)."""
    names = []
    for path in sorted([*ROOT.glob("tasks/**/*.py"), *ROOT.glob("flows/**/*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_by(module: str) -> set[str]:
    """The project modules `module` imports anywhere in its code (inside functions too), and those
    it names in a string: worker processes (`python -m tasks.train.loop`) and vLLM's connector
    module are started by name."""
    known = set(module_names())
    tree = ast.parse(Path(find_spec(module).origin).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                      for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
            found.add(node.value)
    return {m for m in found if m in known and m != module}


def runs(roots: list[str]) -> set[str]:
    """Every project module that running `roots` can import, `roots` included."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imported_by(module))
    return {m for m in seen if not find_spec(m).origin.endswith("__init__.py")}


@pytest.mark.parametrize("code, roots", [
    ("PREPARE_CODE", ["tasks.prepare.stage", "tasks.prepare.regenerate", "tasks.prepare.synthesize"]),
    ("EXTRACT_CODE", ["tasks.extract.stage"]),
    ("VOCAB_CODE", ["tasks.vocab"]),
    ("TRAIN_CODE", ["tasks.train.stage"]),
    ("VALIDATE_CODE", ["tasks.validate.stage"]),
    ("DRIFT_CODE", ["tasks.drift.decision", "tasks.drift.samples"]),  # the retraining loop's (flows/retraining.py)
])
def test_each_stage_cache_key_holds_the_source_of_every_module_it_runs(code, roots):
    listed = set(getattr(flows.stages, code, None) or getattr(flows.retraining, code))
    needed = runs(roots) - set(flows.stages.PLUMBING)
    assert not needed - listed, f"flows/stages.py {code} lacks {sorted(needed - listed)}: a change there would " \
                                "not re-run the stage"
    assert not listed - needed, f"flows/stages.py {code} lists {sorted(listed - needed)}, which the stage never runs"


def test_no_module_imports_itself_through_others():
    graph = {m: imported_by(m) for m in module_names()}
    cycles = []

    def visit(module: str, path: list[str], done: set[str]) -> None:
        for nxt in sorted(graph[module]):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt], done)
        done.add(module)

    done: set[str] = set()
    for module in graph:
        if module not in done:
            visit(module, [module], done)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# A stage's light modules stay light: the CLI reads a config without torch or Prefect, and preparing
# data or driving a vLLM subprocess never loads torch in the caller.
@pytest.mark.parametrize("module, never", [
    ("flows.cli", ["torch", "prefect", "transformers", "vllm"]),
    ("tasks.prepare.stage", ["torch", "prefect", "vllm", "speculators"]),
    ("tasks.prepare.regenerate", ["torch", "prefect", "vllm", "speculators"]),
    ("tasks.validate.vllm_live", ["torch", "prefect", "vllm", "speculators"]),
    ("tasks.preflight", ["torch", "prefect", "transformers", "vllm"]),
    ("tasks.train.job", ["torch", "prefect", "speculators"]),
    ("tasks.extract.shards", ["transformers", "prefect", "vllm", "speculators"]),
    *[(package, ["torch", "prefect", "transformers", "vllm", "pydantic"])
      for package in ("tasks", "tasks.common", "tasks.prepare", "tasks.extract", "tasks.train", "tasks.validate")],
])
def test_a_module_loads_only_what_it_needs(module, never):
    code = f"import sys, {module}; print(' '.join(m for m in {never!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.split() == [], f"importing {module} loads {loaded.stdout.strip()}"


def test_what_the_stages_share_imports_no_stage():
    common = [m for m in module_names() if m.startswith("tasks.common.")]
    upward = {m: sorted(i for i in imported_by(m) if not i.startswith("tasks.common")) for m in common}
    assert not any(upward.values()), {m: i for m, i in upward.items() if i}
