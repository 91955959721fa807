"""verifier.path as a Hub id: resolved through a real huggingface_hub cache (the demo SmolLM2's files,
laid out as `hf download` leaves them) with HF_HUB_OFFLINE=1, in a process of its own (huggingface_hub
reads HF_HOME and HF_HUB_OFFLINE when imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.common.verifier import TOKENIZER_FILES, VerifierError, inspect_verifier, verifier_fingerprint
from tests.hub_cache import lay_out_repo, offline_env

ROOT = Path(__file__).resolve().parents[2]
RESOLVE = """
import json, sys
from tasks.common.config import VerifierSettings
from tasks.common.demo_assets import resolve_verifier
settings = resolve_verifier(VerifierSettings(path=sys.argv[1], revision=sys.argv[2] or None))
print(json.dumps({"path": settings.path, "revision": settings.revision}))
"""


def smollm2_files(smollm2: str, weights: bool = True) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(smollm2).iterdir())
            if p.name != "CHECKSUMS.json" and (weights or p.suffix != ".safetensors")}


def resolve(hf_home: Path, path: str, revision: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", RESOLVE, path, revision], capture_output=True, text=True,
                          cwd=ROOT, env=offline_env(hf_home))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_an_id_resolves_to_its_cached_snapshot_and_a_new_revision_is_a_new_verifier(smollm2, tmp_path):
    files = smollm2_files(smollm2)
    main = lay_out_repo(tmp_path / "hf" / "hub", "model", "org/SmolLM2-135M-Instruct", files)
    tagged = lay_out_repo(tmp_path / "hf" / "hub", "model", "org/SmolLM2-135M-Instruct", files, ref="v2")
    assert resolve(tmp_path / "hf", "org/SmolLM2-135M-Instruct") == {"path": str(main), "revision": main.name}
    assert resolve(tmp_path / "hf", "org/SmolLM2-135M-Instruct", "v2") == {"path": str(tagged),
                                                                           "revision": tagged.name}
    # the same bytes: read alike, but each commit (and the local folder) is a verifier of its own
    assert inspect_verifier(main).num_layers == inspect_verifier(tagged).num_layers == inspect_verifier(smollm2).num_layers
    assert inspect_verifier(main).weight_bytes == inspect_verifier(smollm2).weight_bytes
    fingerprints = {verifier_fingerprint(p) for p in (main, tagged, smollm2)}
    assert len(fingerprints) == 3
    assert verifier_fingerprint(main) == verifier_fingerprint(main)


def test_a_revision_needs_an_id(smollm2):
    from tasks.common.config import VerifierSettings
    from tasks.common.demo_assets import resolve_verifier

    with pytest.raises(VerifierError, match="verifier.revision 'v2' picks a revision of a Hub id"):
        resolve_verifier(VerifierSettings(path=smollm2, revision="v2"))


def cli(hf_home: Path, tmp_path: Path, command: str, *settings: str) -> subprocess.CompletedProcess:
    config = yaml.safe_load((ROOT / "deployments" / "demo.yaml").read_text())
    config |= {"output_dir": str(tmp_path / "out"), "validation": {"live": "skip"}}
    config["data"] |= {"max_rows": 20, "regenerate": {"enabled": False}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    args = [a for s in settings for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "flows.cli", command, str(tmp_path / "config.yaml"), *args],
                          capture_output=True, text=True, cwd=ROOT, env=offline_env(hf_home), timeout=600)


def test_plan_takes_an_id_with_only_config_and_tokenizer_cached_and_a_run_names_the_missing_weights(
        smollm2, tmp_path):
    files = smollm2_files(smollm2, weights=False)
    assert set(files) >= {"config.json", *(n for n in TOKENIZER_FILES if (Path(smollm2) / n).is_file())}
    snapshot = lay_out_repo(tmp_path / "hf" / "hub", "model", "org/SmolLM2-135M-Instruct", files)
    planned = cli(tmp_path / "hf", tmp_path, "plan", "verifier.path=org/SmolLM2-135M-Instruct")
    assert planned.returncode == 0, planned.stderr
    assert f"for {snapshot}" in planned.stderr and "layers" in planned.stdout
    run = cli(tmp_path / "hf", tmp_path, "run", "verifier.path=org/SmolLM2-135M-Instruct")
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        f"error: verifier.path {snapshot} holds no weight files (*.safetensors, *.bin, *.gguf): download them with "
        f"`hf download org/SmolLM2-135M-Instruct --revision {snapshot.name}`")
    assert not (tmp_path / "out").exists()


def test_an_id_neither_cached_nor_reachable_is_one_error_before_any_work(tmp_path):
    run = cli(tmp_path / "hf", tmp_path, "run", "verifier.path=org/not-downloaded")
    assert run.returncode == 2, run.stderr
    (error,) = run.stderr.strip().splitlines()
    assert error.startswith("error: Hub model org/not-downloaded is not in the Hugging Face cache")
    assert "`hf download org/not-downloaded`" in error and "check the name" in error
    assert not (tmp_path / "out").exists()
