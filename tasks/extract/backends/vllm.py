"""Hidden-state capture with vLLM's `extract_hidden_states` (production: tensor parallel).

A weightless "draft" method makes vLLM write the verifier's hidden states at the requested
layer ids (layer id k = after k decoder layers; id N is the last layer before the final norm,
as in the transformers backend) to one small file per request, through a KV connector; they
are read back and packed like the transformers backend's output, then written into the same
fingerprinted shards. Files go to /dev/shm when it exists (RAM, never the shard disk).

vLLM loads a verifier by its architecture, a multimodal wrapper (Llava, Kimi-K2.5) included; before
an engine starts, tasks/common/vllm_support.py checks that this vLLM has it, and that its model class
emits auxiliary hidden states: vLLM captures them through the interface that feeds EAGLE-3 drafts,
so a model without EAGLE-3 support cannot be extracted by vLLM either (the engine would die at start
with "Model does not support EAGLE3 interface").
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tasks.common.progress import LoadMonitor, ProgressCallback
from tasks.common.verifier import VerifierError, VerifierInfo
from tasks.common.vllm_support import (
    EXTRACTION_ADVICE,
    check_architecture,
    cpu_kv_cache_bytes,
    eagle3_support,
    quiet_shutdown_warnings,
)

log = logging.getLogger(__name__)


class VllmBackend:
    name = "vllm"
    device = "cpu"  # captured states arrive in host memory

    def __init__(self, verifier: VerifierInfo, layers: list[int], dtype: str, settings, trust_remote_code: bool = False):
        self.verifier = verifier
        self.layers = layers
        self.dtype = dtype
        self.settings = settings
        self.trust_remote_code = trust_remote_code
        self.llm = None
        self.model = None  # the transformers backend's attribute: "is the verifier loaded"

    def load(self, callback: ProgressCallback | None = None) -> None:
        from vllm import LLM

        check_architecture(self.verifier)
        quiet_shutdown_warnings()
        support = eagle3_support(self.verifier)
        if not support.supported:
            raise VerifierError(f"{support.problem}; {EXTRACTION_ADVICE}")
        scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.storage = tempfile.mkdtemp(prefix="eagle3-hs-", dir=scratch)
        on_cpu = not torch.cuda.is_available()
        connector = ({"kv_connector": "CPUHiddenStatesConnector",
                      "kv_connector_module_path": "tasks.extract.backends.vllm_connector"}
                     if on_cpu else {"kv_connector": "ExampleHiddenStatesConnector"})
        memory = {"gpu_memory_utilization": self.settings.gpu_memory_utilization}
        if on_cpu:
            # On CPU that flag would reserve a share of host RAM; the space is what two batches need at once
            # (one finishing, the next scheduled), with the 4 captured float32 hidden states of each token.
            captured = 4 * 4 * self.verifier.hidden_size
            memory = {"kv_cache_memory_bytes": cpu_kv_cache_bytes(self.verifier.path, 2 * self.settings.batch_tokens,
                                                                  extra_bytes_per_token=captured)}
        with LoadMonitor(f"verifier {self.verifier.path.name} (vLLM, TP={self.settings.tensor_parallel_size})",
                         self.verifier.weight_bytes, callback):
            self.llm = LLM(
                model=str(self.verifier.path), dtype=self.dtype, trust_remote_code=self.trust_remote_code,
                tensor_parallel_size=self.settings.tensor_parallel_size,
                **memory,
                max_model_len=self.settings.batch_tokens, max_num_batched_tokens=self.settings.batch_tokens,
                enable_prefix_caching=False,  # a cached prefix skips the forward pass: its states would be missing
                enforce_eager=on_cpu, seed=0,
                speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layers}}},
                kv_transfer_config={**connector, "kv_role": "kv_producer",
                                    "kv_connector_extra_config": {"shared_storage_path": self.storage}},
            )
        self.model = self.llm

    def capture(self, batch: list[list[int]]) -> torch.Tensor:
        from vllm import SamplingParams, TokensPrompt
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch],
                                    SamplingParams(max_tokens=1), use_tqdm=False)
        states = []
        for ids, out in zip(batch, outputs, strict=True):
            path = out.kv_transfer_params["hidden_states_path"]
            data = load_hidden_states(path)  # waits for the connector's write
            cleanup_hidden_states(path)
            if data["token_ids"].tolist() != ids or data["hidden_states"].shape[0] != len(ids):
                raise RuntimeError(f"vLLM returned states for other tokens ({data['hidden_states'].shape[0]} "
                                   f"rows for a {len(ids)}-token sample)")
            states.append(data["hidden_states"])
        return torch.cat(states).to(torch.bfloat16)

    def close(self) -> None:
        self.llm = self.model = None
        gc.collect()
        shutil.rmtree(getattr(self, "storage", ""), ignore_errors=True)
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
