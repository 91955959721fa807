"""Hidden-state capture with Hugging Face transformers (any machine, any architectures it loads).

Layer id k means transformers' `output_hidden_states[k]`: the output of decoder layer k-1. The last
id, N, is the last decoder layer's output *before* the final norm, which is what vLLM's
`extract_hidden_states` returns (transformers' `output_hidden_states[N]` is after the norm;
speculators applies the verifier's norm itself). Forward hooks on the decoder layers capture
exactly the requested ids, and the decoder runs without the LM head: no logits are computed.

A multimodal wrapper (Llava, Kimi-K2.5, ...: the language model's config under `text_config`, its
weights under a prefix) loads as its language model alone: the decoder is built from the nested
config and its weights are read from the wrapper's files through a prefix mapping found in the
checkpoint's key names (transformers' `key_mapping`); vision weights are never read, and no remote
code is needed where transformers knows the language model's architecture.
"""

from __future__ import annotations

import logging
import re

import torch

from tasks.common.progress import LoadMonitor, ProgressCallback
from tasks.common.verifier import (
    VerifierError,
    VerifierInfo,
    checkpoint_keys,
    read_config,
    text_config,
    transformers_text_config,
)

log = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The verifier's decoder layers, wherever its wrapper keeps them."""
    candidates = [m for name, m in model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers and name.endswith("layers")]
    if not candidates:
        raise RuntimeError(f"no ModuleList of {num_layers} decoder layers found in {type(model).__name__}")
    return candidates[0]  # the outermost: a vision tower's layers come after the language model's by name


def language_model_prefix(keys: list[str], decoder_keys: list[str], where) -> str:
    """The prefix under which the checkpoint holds the decoder's tensors (`model.language_model.`
    for Llava, `language_model.model.` for Kimi-K2.5): the one under which every embedding and
    norm weight of the decoder is found (tensors a quantized checkpoint keeps under their own
    names; whether all the others loaded is checked after loading)."""
    anchors = [k for k in decoder_keys if k.endswith("norm.weight") or "embed_tokens" in k] or decoder_keys
    probe = next((k for k in anchors if ".0." in k), anchors[0])
    candidates = {k[: -len(probe)] for k in keys if k.endswith(probe)}
    available = set(keys)
    complete = sorted((p for p in candidates if all(p + k in available for k in anchors)), key=len)
    if not complete:
        raise VerifierError(
            f"{where}: the language model's weights are not in the checkpoint under one prefix (looked for "
            f"'<prefix>{probe}' and the decoder's {len(anchors) - 1} other embedding and norm weights; candidates "
            f"{sorted(candidates) or 'none'})")
    return complete[0]


def wrapper_text_config(verifier: VerifierInfo):
    """The language model's config as the wrapper's own config class builds it (Kimi-K2.5's names its
    DeepSeek-V3 body "kimi_k2"), or None where transformers knows neither."""
    try:
        return transformers_text_config(verifier.path)
    except (KeyError, ValueError, OSError):
        return None


def load_language_model(verifier: VerifierInfo, dtype: torch.dtype, device_map, trust_remote_code: bool):
    """The decoder of a wrapper's language model, built from its nested config, its weights read
    under their prefix in the wrapper's checkpoint."""
    from transformers import AutoConfig, AutoModel

    nested, key = text_config(read_config(verifier.path))
    model_type = nested.get("model_type")
    try:
        config = AutoConfig.for_model(**nested)
    except (KeyError, ValueError):
        config = wrapper_text_config(verifier)
        if config is None:
            if trust_remote_code:  # the wrapper's own code builds (and loads) the whole model
                return None
            from transformers import __version__

            raise VerifierError(
                f"{verifier.path}: transformers {__version__} does not know the language model in config.json"
                f"[{key!r}] (model_type {model_type!r}); set verifier.trust_remote_code: true if the folder ships "
                "its code") from None
    with torch.device("meta"):
        decoder_keys = list(AutoModel.from_config(config).state_dict())
    prefix = language_model_prefix(checkpoint_keys(verifier), decoder_keys, verifier.path)
    log.info("verifier %s: loading its language model (%s, config.json[%r]) alone, weights under '%s'",
             verifier.path.name, type(config).__name__.removesuffix("Config"), key, prefix)
    from transformers.utils import logging as hf_logging

    report = hf_logging.get_logger("transformers.modeling_utils")  # its load report lists every vision tensor
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        model, info = AutoModel.from_pretrained(verifier.path, config=config, dtype=dtype, device_map=device_map,
                                                key_mapping={f"^{re.escape(prefix)}": ""}, output_loading_info=True)
    finally:
        report.setLevel(level)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise VerifierError(f"{verifier.path}: the language model's tensors under '{prefix}' do not fit its config: "
                            f"missing {sorted(info['missing_keys'])[:5]}, mismatched {list(info['mismatched_keys'])[:5]}")
    log.info("verifier %s: %d tensors of the wrapper left unread (vision tower, projector, LM head)",
             verifier.path.name, len(info["unexpected_keys"]))
    return model


class TransformersBackend:
    name = "transformers"

    def __init__(self, verifier: VerifierInfo, layers: list[int], dtype: str = "bfloat16", device: str = "auto",
                 trust_remote_code: bool = False, compile: bool = False):
        self.verifier = verifier
        self.layers = layers  # the 3 auxiliary ids, then N
        self.dtype = getattr(torch, dtype)
        self.device = resolve_device(device)
        self.trust_remote_code = trust_remote_code
        self.compile = compile
        self.model = None
        self._captured: dict[int, torch.Tensor] = {}

    def load(self, callback: ProgressCallback | None = None) -> None:
        from transformers import AutoModelForCausalLM

        # several GPUs visible to one process: accelerate spreads the layers over them
        device_map = "auto" if self.device == "cuda" else self.device
        with LoadMonitor(f"verifier {self.verifier.path.name}", self.verifier.weight_bytes, callback):
            model = None
            if self.verifier.text_config_key is not None:
                model = load_language_model(self.verifier, self.dtype, device_map, self.trust_remote_code)
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(self.verifier.path, dtype=self.dtype,
                                                             device_map=device_map,
                                                             trust_remote_code=self.trust_remote_code)
        self.attach(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Use an already built model (benchmarks build random-weight verifiers in memory)."""
        model.eval()
        self.model = model
        self.decoder = model.get_decoder()
        layers = decoder_layers(self.decoder, self.verifier.num_layers)
        for k in self.layers:
            layers[k - 1].register_forward_hook(self._hook(k))
        if self.compile:
            self.compile_layers()
        self.input_device = self.decoder.get_input_embeddings().weight.device

    def compile_layers(self) -> None:
        """Regional compilation: every decoder layer runs one compiled graph (the layers share their
        code, so it compiles once, in seconds rather than the whole model's minutes), with symbolic
        batch and sequence sizes (no recompile per batch shape). The capture hooks stay outside the
        compiled region: they run in each layer's __call__."""
        for layer in decoder_layers(self.decoder, self.verifier.num_layers):
            layer.forward = torch.compile(layer.forward, dynamic=True)

    def _hook(self, k: int):
        def capture(_module, _args, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return capture

    @torch.inference_mode()
    def capture(self, batch: list[list[int]]) -> torch.Tensor:
        """Hidden states of every token of every sequence, back to back: [sum(len), len(layers), H].

        Rows are padded on the right and run with no attention mask: under causal attention a token
        never attends to the pads after it, so its states are those of its sequence alone, and SDPA
        keeps its fastest (flash) kernel, which any explicit mask rules out. The pads' own states
        are computed and dropped.

        Nothing here waits for the device: inputs go up asynchronously, and the positions of the
        real (unpadded) tokens are computed on the host, so the next batch is queued while this one
        computes (a boolean-mask gather would synchronize on every batch)."""
        lengths = [len(s) for s in batch]
        width = max(lengths)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        for i, seq in enumerate(batch):
            input_ids[i, : len(seq)] = torch.as_tensor(seq)
        flat_positions = torch.cat([torch.arange(n) + i * width for i, n in enumerate(lengths)])
        pin = self.input_device.type == "cuda"
        if pin:
            input_ids, flat_positions = input_ids.pin_memory(), flat_positions.pin_memory()
        self._captured.clear()
        self.decoder(input_ids=input_ids.to(self.input_device, non_blocking=pin), use_cache=False)
        first = self._captured[self.layers[0]]
        out = torch.empty(len(flat_positions), len(self.layers), first.shape[-1], dtype=first.dtype, device=first.device)
        positions = flat_positions.to(first.device, non_blocking=pin)
        for j, k in enumerate(self.layers):
            states = self._captured[k].to(first.device).reshape(-1, first.shape[-1])
            out[:, j] = states.index_select(0, positions)  # only the real tokens, layer by layer
        self._captured.clear()
        return out

    def close(self) -> None:
        self.model = self.decoder = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
