"""Hidden-state capture with Hugging Face transformers (any machine, any architectures it loads).

Layer id k means transformers' `output_hidden_states[k]`: the output of decoder layer k-1. The last
id, N, is the last decoder layer's output *before* the final norm, which is what vLLM's
`extract_hidden_states` returns (transformers' `output_hidden_states[N]` is after the norm;
speculators applies the verifier's norm itself). Forward hooks on the decoder layers capture
exactly the requested ids, and the decoder runs without the LM head: no logits are computed.
"""

from __future__ import annotations

import logging

import torch

from tasks.progress import LoadMonitor, ProgressCallback
from tasks.verifier import VerifierInfo

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


class TransformersBackend:
    name = "transformers"

    def __init__(self, verifier: VerifierInfo, layers: list[int], dtype: str = "bfloat16", device: str = "auto",
                 trust_remote_code: bool = False):
        self.verifier = verifier
        self.layers = layers  # the 3 auxiliary ids, then N
        self.dtype = getattr(torch, dtype)
        self.device = resolve_device(device)
        self.trust_remote_code = trust_remote_code
        self.model = None
        self._captured: dict[int, torch.Tensor] = {}

    def load(self, callback: ProgressCallback | None = None) -> None:
        from transformers import AutoModelForCausalLM

        with LoadMonitor(f"verifier {self.verifier.path.name}", self.verifier.weight_bytes, callback):
            model = AutoModelForCausalLM.from_pretrained(
                self.verifier.path,
                dtype=self.dtype,
                # several GPUs visible to one process: accelerate spreads the layers over them
                device_map="auto" if self.device == "cuda" else self.device,
                trust_remote_code=self.trust_remote_code,
            )
        self.attach(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Use an already built model (benchmarks build random-weight verifiers in memory)."""
        model.eval()
        self.model = model
        self.decoder = model.get_decoder()
        layers = decoder_layers(self.decoder, self.verifier.num_layers)
        for k in self.layers:
            layers[k - 1].register_forward_hook(self._hook(k))
        self.input_device = self.decoder.get_input_embeddings().weight.device

    def _hook(self, k: int):
        def capture(_module, _args, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return capture

    @torch.inference_mode()
    def capture(self, batch: list[list[int]]) -> torch.Tensor:
        """Hidden states of every token of every sequence, packed: [sum(len), len(layers), H].

        Nothing here waits for the device: inputs go up asynchronously, and the positions of the
        real (unpadded) tokens are computed on the host, so the next batch is queued while this one
        computes (a boolean-mask gather would synchronize on every batch)."""
        lengths = [len(s) for s in batch]
        width = max(lengths)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        for i, seq in enumerate(batch):
            input_ids[i, : len(seq)] = torch.as_tensor(seq)
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        flat_positions = torch.cat([torch.arange(n) + i * width for i, n in enumerate(lengths)])
        pin = self.input_device.type == "cuda"
        if pin:
            input_ids, mask, flat_positions = input_ids.pin_memory(), mask.pin_memory(), flat_positions.pin_memory()
        device = self.input_device
        self._captured.clear()
        self.decoder(input_ids=input_ids.to(device, non_blocking=pin),
                     attention_mask=mask.to(device, non_blocking=pin).long(), use_cache=False)
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
