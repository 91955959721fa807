"""The draft registry on real drafts: versions written whole, promotion and rollback restoring the bytes
served before, the regression gate, kills during promotion and registration, and the CLI."""

from __future__ import annotations

import filecmp
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
import yaml
from conftest import AUX, with_vllm_measurement
from pictures import colour_pixels

from tasks.common.config import PipelineConfig, ValidationSettings
from tasks.common.plots import ESTIMATED, MEASURED
from tasks.common.verifier import verifier_fingerprint
from tasks.registry.gate import gate
from tasks.registry.layout import RegistryError, current, references, versions
from tasks.registry.listing import table
from tasks.registry.picture import draw_acceptance
from tasks.registry.promotion import history, made_current, promote, rollback
from tasks.registry.register import register
from tasks.validate.draft_check import DraftCheckError
from tasks.validate.stage import validate

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / ".venv" / "bin" / "eagle3-pipeline"


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return names == sorted(p.name for p in b.iterdir()) and not mismatch and not errors


def lineage(smollm2: str, sharegpt: str, run: Path, parent: str | None) -> dict:
    config = PipelineConfig(verifier={"path": smollm2}, data={"sources": [sharegpt]}, output_dir=str(run))
    return {"verifier": smollm2, "verifier_fingerprint": verifier_fingerprint(smollm2),
            "data_fingerprints": {"prepared": run.name}, "parent": parent,
            "config": config.model_dump(mode="json"), "references": [str(run / "train"), str(run / "hidden_states")]}


@pytest.fixture(scope="module")
def measured(drafts, tmp_path_factory) -> list[Path]:
    """Validation folders of the drafts with a vLLM measurement each: 2.0, 2.2 and 1.6 tokens per step."""
    root = tmp_path_factory.mktemp("measured")
    counts = [[600, 300, 100], [650, 380, 170], [400, 150, 50]]
    return [with_vllm_measurement(validation, root / f"v{i}", count, 1000)
            for i, ((_, validation), count) in enumerate(zip(drafts, counts, strict=True))]


@pytest.fixture(scope="module")
def failed(drafts, smollm2, tmp_path_factory) -> tuple[Path, Path]:
    """A draft whose validation failed (its auxiliary layers are not the ones it was trained on), and its report."""
    root = tmp_path_factory.mktemp("failed")
    draft = root / "draft"
    shutil.copytree(drafts[2][0], draft)
    config = json.loads((draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [3, 15, 27]
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftCheckError):
        validate(str(draft), smollm2, AUX, ValidationSettings(live="skip"), root / "validation")
    return draft, root / "validation"


def register_all(registry: Path, drafts, reports, smollm2, sharegpt, tmp_path) -> list:
    made, parent = [], None
    for i, ((draft, _), report) in enumerate(zip(drafts, reports, strict=True)):
        made.append(register(registry, draft, report, lineage(smollm2, sharegpt, tmp_path / f"run{i}", parent)))
        parent = f"version {made[-1].number}"
    return made


def test_versions_are_whole_copies_and_rollback_restores_the_previous_bytes(drafts, measured, smollm2, sharegpt,
                                                                           tmp_path):
    registry = tmp_path / "registry" / "eagle3"
    made = register_all(registry, drafts, measured, smollm2, sharegpt, tmp_path)
    assert [v.number for v in made] == [1, 2, 3] and current(registry) is None
    for version, (draft, _), report in zip(made, drafts, measured, strict=True):
        assert same_files(version.draft, draft)
        assert (version.path / "report.json").read_bytes() == (report / "report.json").read_bytes()
        assert version.tau == pytest.approx(json.loads((report / "report.json").read_text())["live"]["draft"]
                                            ["mean_acceptance_length"])
        assert str(version.draft) in version.serve_command() and os.access(version.path / "serve.sh", os.X_OK)
        assert version.serve_command() in (version.path / "serve.sh").read_text()
    assert str(tmp_path / "run1" / "train") in references(registry)
    assert register(registry, drafts[0][0], measured[0], lineage(smollm2, sharegpt, tmp_path / "again", None)) \
        .number == 1 and len(versions(registry)) == 3  # the same files again: the same version

    for version in made:
        promote(registry, version.number, f"test: version {version.number}")
    assert current(registry).number == 3 and same_files(registry / "current" / "draft", drafts[2][0])
    assert rollback(registry).number == 2
    assert same_files(registry / "current" / "draft", drafts[1][0])
    assert rollback(registry).number == 1 and same_files(registry / "current" / "draft", drafts[0][0])
    with pytest.raises(RegistryError, match="nothing to roll back to: version 1 is the first"):
        rollback(registry)
    with pytest.raises(RegistryError, match="version 1 is already current"):
        promote(registry, 1, "again")
    promote(registry, 3, "test: back to 3")
    assert rollback(registry, "test: 3 withdrawn").number == 1  # the version current before the last promotion
    assert [(r["action"], r["from"], r["to"]) for r in history(registry)] == [
        ("promote", None, 1), ("promote", 1, 2), ("promote", 2, 3), ("rollback", 3, 2), ("rollback", 2, 1),
        ("promote", 1, 3), ("rollback", 3, 1)]
    assert history(registry)[-1]["why"] == "test: 3 withdrawn"

    rows = table(registry).splitlines()
    assert len(rows) == 4 and rows[2].split()[0] == "2" and rows[2].endswith("version 1")  # its parent
    assert rows[1].rstrip().endswith("*") and not rows[3].rstrip().endswith("*")
    picture = draw_acceptance(registry)
    assert colour_pixels(picture, MEASURED) > 500 and colour_pixels(picture, ESTIMATED) == 0  # no simulated figure


def test_the_gate_both_ways(drafts, measured, failed, smollm2, sharegpt, tmp_path):
    registry = tmp_path / "registry"
    reports = [json.loads((r / "report.json").read_text()) for r in measured]
    ok, why = gate(reports[0], None, 0.05)
    assert ok and "no current version" in why
    first = register(registry, drafts[0][0], measured[0], lineage(smollm2, sharegpt, tmp_path / "run", None))
    better, worse = reports[1], reports[2]  # τ 2.2 and 1.6 against version 1's 2.0
    ok, why = gate(better, first, 0.05)
    assert ok and "τ 2.200 against version 1's 2.000, at least 1.900 allowed" in why
    ok, why = gate(worse, first, 0.05)
    assert not ok and why.startswith("τ regressed: τ 1.600 against version 1's 2.000")
    assert gate(worse, first, 0.25)[0]  # a drop of 20% is within 25%

    unmeasured = json.loads((drafts[1][1] / "report.json").read_text())
    ok, why = gate(unmeasured, first, 0.05)
    assert ok and "τ not compared: the candidate has no vLLM measurement" in why
    failed_report = json.loads((failed[1] / "report.json").read_text())
    ok, why = gate(failed_report, first, 0.05)
    assert not ok and "static checks" in why and "aux" in why
    rejected = register(registry, failed[0], failed[1], lineage(smollm2, sharegpt, tmp_path / "run2", "version 1"))
    with pytest.raises(RegistryError, match=f"version {rejected.number} cannot be made current: validation failed"):
        promote(registry, rejected.number, "test")
    assert current(registry) is None


# Promotes, in a loop, whichever of versions 2 and 3 is not current; killed at a random moment.
PROMOTE_LOOP = """
import sys
from tasks.registry.layout import current
from tasks.registry.promotion import promote
registry = sys.argv[1]
print("ready", flush=True)
while True:
    promote(registry, 2 if current(registry).number == 3 else 3, "kill trial")
"""


def test_a_kill_during_promotion_leaves_current_at_the_old_or_the_new_version(drafts, measured, smollm2, sharegpt,
                                                                             tmp_path):
    registry = tmp_path / "registry"
    register_all(registry, drafts, measured, smollm2, sharegpt, tmp_path)
    promote(registry, 1, "before the trials")
    rng, seen, deadline = random.Random(0), set(), time.monotonic() + 40
    for trial in range(20):
        assert time.monotonic() < deadline, f"20 kill trials took over 40 s ({trial} done)"
        loop = subprocess.Popen([sys.executable, "-c", PROMOTE_LOOP, str(registry)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert loop.stdout.readline() == "ready\n", loop.stderr.read()
        time.sleep(rng.uniform(0, 0.05))
        loop.send_signal(signal.SIGKILL)
        _, errors = loop.communicate()
        assert loop.returncode == -signal.SIGKILL, errors  # it was promoting, not stopped by an error
        now = current(registry)  # raises where `current` is missing or points at no version
        assert os.readlink(registry / "current") == f"versions/{now.number}"
        assert same_files(registry / "current" / "draft", drafts[now.number - 1][0])
        assert made_current(history(registry), now.number)[-1] == now.number  # the history agrees with `current`
        seen.add(now.number)
    # 1 (the old version) where a kill landed before the loop's first promotion ended: seen once, 2026-12-07
    assert {2, 3} <= seen <= {1, 2, 3}, f"every kill left version {seen}: the kills did not land at varied moments"
    records = history(registry)
    assert any(following["from"] != record["to"] for record, following in pairwise(records)), \
        "no kill landed between a promotion's record and its switch"
    before = current(registry).number
    back = rollback(registry).number  # after the kills, rollback goes back exactly one promotion
    assert back != before and made_current(history(registry), back)[-1] == back


# Registers a draft; killed at a random moment of writing it (after its temporary folder appeared).
REGISTER = """
import json, sys
from tasks.registry.register import register
register(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
"""


def test_a_kill_while_registering_leaves_no_half_version(drafts, measured, smollm2, sharegpt, tmp_path):
    rng, cut = random.Random(1), 0
    for trial in range(5):
        registry = tmp_path / f"registry{trial}"
        run = lineage(smollm2, sharegpt, tmp_path / "run", None)
        proc = subprocess.Popen([sys.executable, "-c", REGISTER, str(registry), str(drafts[0][0]), str(measured[0]),
                                 json.dumps(run)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not (registry / "versions" / ".tmp-1").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "registering never began writing its version"
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        _, errors = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, errors
        found = versions(registry)
        assert [v.number for v in found] in ([], [1])
        if found:
            assert same_files(found[0].draft, drafts[0][0]) and found[0].lineage()["version"] == 1
        else:
            cut += 1  # killed while writing: only its temporary folder is there, which is no version
        # whatever the kill left, registering again gives version 1, complete, and no temporary folder
        again = register(registry, drafts[0][0], measured[0], run)
        assert again.number == 1 and same_files(again.draft, drafts[0][0])
        assert [p.name for p in (registry / "versions").iterdir()] == ["1"]
    assert cut, "every kill came after the version was written: none tested a half-written one"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "drafts", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_drafts_list_promote_rollback_through_the_cli(drafts, measured, smollm2, sharegpt, tmp_path):
    config = tmp_path / "retrain.yaml"
    config.write_text(yaml.safe_dump({"name": "support-bot", "output_dir": str(tmp_path / "run"),
                                      "verifier": {"path": smollm2}, "data": {"sources": [sharegpt]},
                                      "registry": {"path": str(tmp_path / "drafts")}}))
    registry = tmp_path / "drafts" / "support-bot"  # <registry.path>/<name>
    empty = cli("list", str(config))
    assert empty.returncode == 0 and empty.stdout.strip() == f"no draft registered in {registry}"
    register_all(registry, drafts[:2], measured[:2], smollm2, sharegpt, tmp_path)

    refused = cli("rollback", "--registry", str(registry))
    assert refused.returncode == 2 and refused.stderr.startswith("error: nothing to roll back in")
    assert cli("promote", "7", str(config)).returncode == 2
    for number in (1, 2):
        done = cli("promote", str(number), "--registry", str(registry), "--reason", f"test {number}")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == f"promoted version {number}: {registry / 'current'} -> " \
                                              f"{registry / 'versions' / str(number)}"
    listing = cli("list", str(config))
    assert listing.returncode == 0
    rows = listing.stdout.splitlines()
    assert rows[0].split()[:2] == ["version", "created"] and rows[2].split()[0] == "2" and rows[2].endswith("*")
    assert cli("promote", "2", str(config)).stderr.strip() == "error: version 2 is already current"
    back = cli("rollback", str(config))
    assert back.returncode == 0 and back.stdout.startswith("rolled back to version 1")
    assert same_files(registry / "current" / "draft", drafts[0][0])
    assert f"serve it with: {current(registry).serve_command()}" in back.stdout
    assert (registry / "acceptance.png").is_file()
    assert history(registry)[-1]["why"] == "rolled back by hand"
    neither = cli("list")
    assert neither.returncode == 2 and "name the registry" in neither.stderr
