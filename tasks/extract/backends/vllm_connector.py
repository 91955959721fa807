"""A CPU-safe variant of vLLM's hidden-states connector (vLLM 0.32/0.33).

The stock `ExampleHiddenStatesConnector._submit_async_write` copies through a CUDA stream into
pinned memory; on a machine without an accelerator the first finished request kills the engine
(`pin_memory=True requires a CUDA or other accelerator backend`). On CPU the KV cache already
lives in host memory, so this slices it and writes the file synchronously, then releases the
`.lock` that readers wait on. Imported by vLLM's worker process through
`kv_connector_module_path="tasks.extract.backends.vllm_connector"`; on GPU the stock connector is used.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """Stands in for the CUDA event that get_finished() polls: the write already happened."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + block_ids[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers may load
        self._req_copy_events[pending.req_id] = _Written()
