"""Continuous batching for the transformers generator (`data.regenerate.refill`): a fixed set of
rows decodes together, and a row whose answer ends takes the next prompt instead of idling until
its batch's longest answer ends (that idling was ~30% of the row-steps of the preset's
regeneration: docs/BENCHMARKS.md, regenerate_tokens_per_s).

How, over one KV cache of `rows` x `positions` slots per layer (`SlotCache`):
- Every row owns its row of the cache. Prompts are prefilled together, left padded to the widest
  of them, into slots [0, width) of their rows; each decoding step then writes every row's new key
  and value at that row's own next slot (a scatter), so rows at different lengths decode together.
- The attention masks are built here, per row: its slots from its first real token to the current
  one, and for sliding-window layers only the last `window` of them. Within a row, slot distance is
  token distance, so sliding windows stay exact.
- Finished rows are refilled in waves: once `refill_at` rows are free (or none is busy), the next
  prompts are prefilled into them, a few thousand tokens per forward, so a refill costs one prefill
  per wave and not one per row.
The decoding step has one shape (rows x 1 token over the whole cache): on a GPU it is compiled once
per cache size, with CUDA graphs. Greedy only (regeneration's default): the answers are those of the
batches in generators.py (the same tokens on a CPU in float32; bf16 on a GPU can flip near-ties, as
any change of batch does). Sampled generation (prompt synthesis) keeps the batches.

Supported (`unsupported_reason`): decoders whose layers all attend over a key/value cache, fully or
in a sliding window, under the sdpa, eager or folded-GQA attention; the rest (linear attention,
state-space layers, flash/flex kernels that take no dense mask) use generators.py's batches.
"""

from __future__ import annotations

import torch
from transformers import Cache

from tasks.prepare.decode_attention import NAME as FOLDED_GQA

PREFILL_TOKENS = 32768  # prompt tokens (padding included) per prefill forward: bounds its activations
ATTENTION_KINDS = ("full_attention", "sliding_attention")


def layer_kinds(config) -> list[str]:
    """Each decoder layer's attention: `layer_types` where the config has them, else every layer
    sliding where `sliding_window` is set (Mistral v0.1's form) and full otherwise."""
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None)
    if kinds:
        return list(kinds)[: text.num_hidden_layers]
    return ["sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"] * text.num_hidden_layers


def unsupported_reason(config) -> str | None:
    """Why a model of `config` (as loaded: its attention implementation set) cannot decode with refill, or None."""
    other = sorted(set(layer_kinds(config)) - set(ATTENTION_KINDS))
    if other:
        return f"layers of kind {', '.join(other)} keep no key/value cache this decoder can refill"
    attention = config._attn_implementation
    if attention not in ("sdpa", "eager", FOLDED_GQA):
        return f"the {attention} attention takes no dense per-row mask"
    return None


class SlotCache(Cache):
    """A key/value cache of `rows` x `positions` slots per layer whose writes this decoder places:
    while prefilling (`prefill_rows` set), a forward's keys go to slots [0, width) of those rows and
    attention sees only the forward's own; while decoding, each row's key goes to its slot in
    `slots` and attention sees the whole cache (the mask says which slots count)."""

    is_compileable = True

    def __init__(self, num_layers: int, rows: int, positions: int):
        super().__init__(layers=[])
        self.rows, self.positions = rows, positions
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.prefill_rows: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None  # [rows] each row's slot for the token being decoded

    def _allocate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        def empty(like):
            return torch.zeros((self.rows, like.shape[1], self.positions, like.shape[3]), dtype=like.dtype,
                               device=like.device)
        self.keys[layer], self.values[layer] = empty(key), empty(value)
        if key.is_cuda:  # fixed addresses: CUDA graphs replay against this memory
            torch._dynamo.mark_static_address(self.keys[layer])
            torch._dynamo.mark_static_address(self.values[layer])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:
            self._allocate(layer_idx, key_states, value_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.prefill_rows is not None:
            width = key_states.shape[2]
            keys[self.prefill_rows, :, :width] = key_states
            values[self.prefill_rows, :, :width] = value_states
            return key_states, value_states
        for cache, new in ((keys, key_states), (values, value_states)):
            cache.scatter_(2, self.slots.view(-1, 1, 1, 1).expand(-1, new.shape[1], 1, new.shape[3]), new)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def __len__(self) -> int:
        return len(self.keys)


class RefillDecoder:
    """Generates answers for many prompts over `rows` rows and one `positions`-slot cache, refilling
    finished rows (see the module's docstring), greedily; `stops`: the token ids that end an answer."""

    def __init__(self, model, rows: int, positions: int, pad: int, stops: set[int], compile_step: bool):
        text = model.config.get_text_config()
        self.model, self.rows, self.positions, self.pad, self.stops = model, rows, positions, pad, stops
        self.device = model.get_input_embeddings().weight.device
        self.kinds = layer_kinds(model.config)
        self.window = getattr(text, "sliding_window", None) or positions
        self.additive = model.config._attn_implementation == "eager"  # eager attention adds its mask
        self.dtype = model.get_input_embeddings().weight.dtype
        self.cache = SlotCache(text.num_hidden_layers, rows, positions)
        self.refill_at = max(1, rows // 8)
        self.waves = 0  # prefill waves run, for reports and tests
        self.step = torch.compile(self._step, mode="reduce-overhead", fullgraph=False) if compile_step else self._step

    def _masks(self, queries: torch.Tensor, first: torch.Tensor, keys: int):
        """Attention masks [rows, 1, len(queries), keys]: a key slot counts for query slot q when it
        holds a real token of the row (>= first) at or before q, within the window for sliding
        layers; a padding query sees itself only (a row with no key would give NaN)."""
        slot = torch.arange(keys, device=self.device)
        q = queries[..., None]
        full = (slot >= first[:, None, None]) & (slot <= q)
        masks = {"full_attention": full | (slot == q),
                 "sliding_attention": (full & (q - slot < self.window)) | (slot == q)}
        if self.additive:
            masks = {k: torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~m, torch.finfo(self.dtype).min) for k, m in masks.items()}
        masks = {k: m[:, None] for k, m in masks.items()}
        if len(set(self.kinds)) == 1:  # one kind: the model takes the tensor for every layer
            return masks[self.kinds[0]]
        return masks  # both kinds: models with both take one mask per kind

    def _step(self, tokens: torch.Tensor, slots: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """One decoding step of every row: the next token after `tokens`, written at `slots`."""
        self.cache.slots = slots
        out = self.model(input_ids=tokens[:, None], position_ids=(slots - first)[:, None],
                         attention_mask=self._masks(slots[:, None], first, self.positions),
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1)

    def _prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Write `prompts` into the cache rows `rows` (left padded to the widest); their first tokens."""
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        first = torch.tensor([width - len(p) for p in prompts], device=self.device)
        slots = torch.arange(width, device=self.device).expand(len(prompts), width)
        self.cache.prefill_rows = torch.tensor(rows, device=self.device)
        try:
            out = self.model(input_ids=ids, position_ids=(slots - first[:, None]).clamp(min=0),
                             attention_mask=self._masks(slots, first, width), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1)
        finally:
            self.cache.prefill_rows = None
        return out.logits[:, -1].argmax(-1)

    def __call__(self, prompts: list[list[int]], limits: list[int], follow_up=None) -> list[list[int]]:
        """Each prompt's generated tokens: up to its limit, its stop token included. `follow_up(i,
        tokens) -> (prompt, limit) | None`, called as prompt i's answer ends, may give a next prompt
        (a conversation's next turn): it is prompt len(prompts), len(prompts) + 1, ... in the order
        they come, and is taken before the rest, so its conversation goes on at once."""
        prompts, limits = list(prompts), list(limits)
        queue = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # pop() takes the longest left
        outputs: list[list[int]] = [[] for _ in prompts]
        holder = [-1] * self.rows  # the prompt each row answers; -1: free
        tokens = torch.full((self.rows,), self.pad, device=self.device)  # each row's last token
        slots = torch.zeros(self.rows, dtype=torch.long, device=self.device)  # the slot it is written at
        first = torch.zeros(self.rows, dtype=torch.long, device=self.device)  # the row's first real token's slot

        def answered(r: int, token: int) -> None:
            """Row r's prompt gets `token`; the row is free again once its answer ends."""
            i = holder[r]
            outputs[i].append(token)
            if token in self.stops or len(outputs[i]) >= limits[i]:
                holder[r] = -1
                after = follow_up(i, outputs[i]) if follow_up else None
                if after:
                    prompt, limit = after
                    if len(prompt) + limit > self.positions:
                        raise ValueError(f"a follow-up prompt of {len(prompt)} tokens and {limit} new ones does not "
                                         f"fit the cache's {self.positions} positions")
                    prompts.append(prompt)
                    limits.append(limit)
                    outputs.append([])
                    queue.append(len(prompts) - 1)

        with torch.inference_mode():
            while True:
                free = [r for r in range(self.rows) if holder[r] < 0]
                if queue and (len(free) >= self.refill_at or len(free) == self.rows):
                    self.waves += 1
                    taken = [queue.pop() for _ in range(min(len(free), len(queue)))]
                    for rows, group in self._groups(free[: len(taken)], taken, prompts):
                        index = torch.tensor(rows, device=self.device)
                        width = max(len(prompts[i]) for i in group)
                        firsts = self._prefill(rows, [prompts[i] for i in group])
                        tokens[index], slots[index] = firsts, width
                        first[index] = torch.tensor([width - len(prompts[i]) for i in group], device=self.device)
                        for r, i, token in zip(rows, group, firsts.tolist(), strict=True):
                            holder[r] = i
                            answered(r, token)
                busy = torch.tensor([h >= 0 for h in holder], device=self.device)
                if not busy.any():
                    return outputs
                # free rows decode padding at slot 0, seeing only themselves
                tokens = torch.where(busy, tokens, self.pad)
                slots, first = torch.where(busy, slots, 0), torch.where(busy, first, 0)
                new = self.step(tokens, slots, first).clone()  # a CUDA graph's output is overwritten next replay
                for r, token in enumerate(new.tolist()):
                    if holder[r] >= 0:
                        answered(r, token)
                tokens, slots = new, slots + 1

    @staticmethod
    def _groups(rows: list[int], taken: list[int], prompts: list[list[int]]):
        """(rows, prompts) per prefill forward: at most PREFILL_TOKENS padded tokens each (longest first)."""
        taken = sorted(taken, key=lambda i: -len(prompts[i]))
        start = 0
        while start < len(taken):
            end = start + max(1, PREFILL_TOKENS // len(prompts[taken[start]]))
            yield rows[start:end], taken[start:end]
            start = end
