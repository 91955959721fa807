"""What every stage needs to know about the verifier, read from its files without loading it.

Plain JSON reading on purpose: it works for any architecture (including remote-code ones that
transformers cannot instantiate here) and for nested configs, where a multimodal wrapper keeps
the language model under `text_config` (Kimi-K2.5, Qwen-VL, Llava, ...), without patching
transformers or speculators.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.common.errors import PermanentError
from tasks.common.hub import download_snapshot, hub_snapshot

if TYPE_CHECKING:
    import torch

# Keys under which multimodal wrappers keep the language model's config.
NESTED_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tiktoken.model",  # Kimi's (read by its remote tokenizer code)
    "spiece.model",
    "vocab.txt",
)
# the files a tokenizer's vocabulary can come from (one of them must be there)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "spiece.model", "vocab.txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# What a Hub model id fetches without its weights (all `plan` reads): configs and the safetensors index
# (*.json), chat templates, tokenizer files, and the code of remote-code models and tokenizers.
HUB_CONFIG_PATTERNS = ["*.json", "*.jinja", "*.py", *TOKENIZER_FILES]


class VerifierError(PermanentError, ValueError):
    """The verifier folder cannot serve this pipeline; the message says why."""


@dataclass(frozen=True)
class VerifierInfo:
    path: Path
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    text_config_key: str | None  # where the language model's config sits, None when top level
    weight_files: tuple[str, ...]
    weight_bytes: int

    @property
    def default_aux_layers(self) -> list[int]:
        """EAGLE-3's default (and vLLM's): early, middle and late layers."""
        n = self.num_layers
        return [2, n // 2, n - 3]

    def aux_layers(self, requested: list[int] | None) -> list[int]:
        """The 3 auxiliary layer ids to capture, checked against this verifier's depth."""
        layers = sorted(requested) if requested is not None else self.default_aux_layers
        if len(layers) != 3 or len(set(layers)) != 3:
            raise VerifierError(f"need exactly 3 distinct auxiliary layers, got {layers} for {self.path}")
        if not all(1 <= k <= self.num_layers for k in layers):
            raise VerifierError(
                f"auxiliary layers {layers} are outside the verifier's depth: ids run 1..{self.num_layers} "
                f"({self.path} has {self.num_layers} layers)"
            )
        return layers


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not path.is_dir():
        raise VerifierError(f"verifier folder not found: {path}")
    if not config_file.is_file():
        raise VerifierError(f"verifier folder {path} has no config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise VerifierError(f"{config_file} is not valid JSON: {e}") from None


def text_config(config: dict) -> tuple[dict, str | None]:
    """The language model's config: the top level, or the nested one of a multimodal wrapper."""
    for key in NESTED_TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and "num_hidden_layers" in nested:
            return nested, key
    return config, None


def inspect_verifier(path: str | Path) -> VerifierInfo:
    path = Path(path)
    config = read_config(path)
    lm, key = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not isinstance(lm.get(k), int)]
    if missing:
        where = f"config.json[{key!r}]" if key else "config.json"
        raise VerifierError(f"{path}: {where} lacks integer {', '.join(missing)}")
    weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    architectures = config.get("architectures") or lm.get("architectures") or ["unknown"]
    return VerifierInfo(
        path=path.resolve(),
        architecture=architectures[0],
        model_type=str(lm.get("model_type") or config.get("model_type") or "unknown"),
        num_layers=lm["num_hidden_layers"],
        hidden_size=lm["hidden_size"],
        vocab_size=lm["vocab_size"],
        text_config_key=key,
        weight_files=tuple(p.name for p in weights),
        weight_bytes=sum(p.stat().st_size for p in weights),
    )


def transformers_text_config(path: str | Path, trust_remote_code: bool = False):
    """The language model's transformers config: a multimodal wrapper's nested one as the wrapper's
    own config class builds it (Kimi-K2.5 names its DeepSeek-V3 body "kimi_k2"), typed as its class's
    model type, so that what transformers keys on it (checkpoint conversions) applies."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    kind = type(text).model_type
    if kind and text.model_type != kind:
        text = AutoConfig.for_model(kind, **{k: v for k, v in text.to_dict().items() if k != "model_type"})
    return text


def remote_tokenizer(path: str | Path) -> str | None:
    """The class a folder's tokenizer_config.json names as code shipped with the model (Kimi's
    tiktoken-based tokenizer), or None when transformers builds the tokenizer itself."""
    config = Path(path) / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        auto = json.loads(config.read_text()).get("auto_map", {}).get("AutoTokenizer")
    except (json.JSONDecodeError, AttributeError):
        return None
    classes = [c for c in (auto if isinstance(auto, list) else [auto]) if c]
    return classes[-1] if classes else None


def check_tokenizer_files(path: str | Path, trust_remote_code: bool) -> None:
    """The folder holds what its tokenizer is built from, and remote tokenizer code is allowed to run."""
    path = Path(path)
    remote = remote_tokenizer(path)
    if remote and not trust_remote_code:
        raise VerifierError(f"the tokenizer in {path} is code shipped with the model ({remote}, from "
                            "tokenizer_config.json's auto_map); set verifier.trust_remote_code: true if you trust it")
    if not remote and not any((path / n).is_file() for n in VOCABULARY_FILES):
        raise VerifierError(f"{path} has no tokenizer: none of {', '.join(VOCABULARY_FILES)} is there; copy the "
                            "tokenizer files from the model's repository")


def tokenizer_fingerprint(path: str | Path) -> str:
    """Content hash of the files that decide tokenization and the chat template."""
    path = Path(path)
    h = hashlib.sha256()
    remote_code = sorted(p.name for p in path.glob("tokenization*.py"))  # a tokenizer shipped as code
    for name in (*TOKENIZER_FILES, *remote_code):
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def verifier_fingerprint(path: str | Path) -> str:
    """Identity of the verifier's outputs: config, tokenizer, and every weight file's header,
    size and first/last MiB. Hashing hundreds of GB is not an option; this catches a different
    model, a different revision, a re-quantization or a truncated copy in milliseconds. A Hub
    snapshot's repository and commit count too: a new revision of the same id is a new verifier."""
    path = Path(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    if snapshot := hub_snapshot(path):
        h.update(f"{snapshot.repo_id}@{snapshot.commit}".encode())
    h.update(tokenizer_fingerprint(path).encode())
    for name in inspect_verifier(path).weight_files:
        f = path / name
        size = f.stat().st_size
        h.update(f"{name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def fetch_verifier(repo_id: str, revision: str | None, weights: bool = True) -> Path:
    """A Hub model's snapshot folder through the Hugging Face cache (HubRepoNotFound when neither the
    cache nor the Hub has it): its configuration and tokenizer files, and with `weights` its
    safetensors files (those the index names where there is one: some repositories also hold
    a consolidated copy of the same weights)."""
    folder = download_snapshot(repo_id, "model", revision, HUB_CONFIG_PATTERNS)
    if not weights:
        return folder
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["*.safetensors"]
    # the commit just resolved, so config and weights are of one revision
    return download_snapshot(repo_id, "model", hub_snapshot(folder).commit, [*HUB_CONFIG_PATTERNS, *files])


def weight_map(verifier: VerifierInfo) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, from the index or the files' headers (no
    tensor is read)."""
    index = verifier.path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = [f for f in verifier.weight_files if f.endswith(".safetensors")]
    if not files:
        raise VerifierError(f"{verifier.path}: its tensors are read by name from safetensors files; found "
                            f"{list(verifier.weight_files)}")
    from safetensors import safe_open

    where = {}
    for name in files:
        with safe_open(str(verifier.path / name), "pt") as f:
            where |= dict.fromkeys(f.keys(), name)
    return where


def checkpoint_keys(verifier: VerifierInfo) -> list[str]:
    return list(weight_map(verifier))


def read_tensors(verifier: VerifierInfo, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """{what: checkpoint key} -> {what: tensor}, each read from the file that holds it."""
    from safetensors import safe_open

    where = weight_map(verifier)
    missing = [key for key in names.values() if key not in where]
    if missing:
        raise VerifierError(f"{verifier.path}: the checkpoint lacks {missing}")
    out = {}
    for what, key in names.items():
        with safe_open(str(verifier.path / where[key]), "pt") as f:
            out[what] = f.get_tensor(key)
    return out
