"""What the installed vLLM can do for a verifier, asked before any engine starts: whether vLLM is
here at all (regeneration, extraction and validation choose their engine by it), and whether it has
a model for the verifier's architecture whose code imports here.

An architecture vLLM does not have, or whose code needs a package that is not installed (vLLM's
Llava needs torchvision), is named in a VerifierError instead of vLLM's "failed to be inspected".
"""

from __future__ import annotations

from tasks.common.verifier import VerifierError, VerifierInfo


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # any import failure (missing, broken CUDA libs) means "not here"
        return False
    return True


def check_architecture(verifier: VerifierInfo) -> None:
    """vLLM has a model for the verifier's architecture and its code imports here."""
    import importlib

    from vllm import __version__
    from vllm.model_executor.models import ModelRegistry

    arch = verifier.architecture
    if arch not in ModelRegistry.get_supported_archs():
        raise VerifierError(f"vLLM {__version__} has no model for {arch} ({verifier.path}); extract.backend: "
                            "transformers loads it (or its language model alone)")
    module = getattr(ModelRegistry.models[arch], "module_name", None)
    try:
        if module:
            importlib.import_module(module)
    except ImportError as e:
        missing = f"the package '{e.name.split('.')[0]}', which is not installed" if e.name else "a missing import"
        raise VerifierError(f"vLLM {__version__} cannot load {arch} ({verifier.path}) here: its model code needs "
                            f"{missing} ({e}); install it, or use extract.backend: transformers") from None
