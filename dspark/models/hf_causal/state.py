"""Per-request, rewindable decode state of a transformers causal LM: a `DynamicCache` plus the token ids.

The cache is built without the model config, so every layer keeps one key/value row per token fed
(sliding-window layers too: their attention mask, not the cache, limits what they see). Forgetting
the tokens after the first n is then exactly `crop`: the kept rows are the very tensors the last call
wrote, and the next call reads nothing else. `crop` is called with a negative count (rows to remove),
the spelling that every transformers release from 4.4x to 5.x accepts.

Layout of one layer at length L (H_kv key/value heads, d head dim):

    keys, values   [1, H_kv, L, d]   row i = token i     truncate(n): keep rows [0, n)
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class HFDecodeState:
    """Everything one request's future forward calls read; rewindable by `truncate`.

    Attributes: `cache` (the request's `DynamicCache`, batch 1), `length` (tokens fed),
    `rewind_floor` (always 0: nothing is ever pruned, so any prefix can be restored),
    `token_ids` LongTensor [length].
    """

    rewind_floor = 0

    def __init__(self):
        self.cache = DynamicCache()
        self._tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self._tokens)

    @property
    def token_ids(self) -> torch.Tensor:
        return torch.tensor(self._tokens, dtype=torch.long)

    def append(self, token_ids: list[int]) -> None:
        """Record tokens the model has just written to the cache."""
        self._tokens.extend(token_ids)

    def truncate(self, n_keep: int) -> None:
        """Forget every token after the first `n_keep` (0 <= n_keep <= length); ValueError otherwise."""
        if isinstance(n_keep, bool) or not isinstance(n_keep, int):
            raise ValueError(f"truncate: n_keep must be an int, got {n_keep!r}")
        if not 0 <= n_keep <= self.length:
            raise ValueError(f"truncate: n_keep={n_keep} outside [0, length={self.length}]")
        drop = self.length - n_keep
        if drop:
            self.cache.crop(-drop)
            del self._tokens[n_keep:]

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) [1, H_kv, length, d] of every layer written so far."""
        if hasattr(self.cache, "layers"):  # transformers 5.x
            return [(layer.keys, layer.values) for layer in self.cache.layers if getattr(layer, "keys", None) is not None]
        return list(zip(self.cache.key_cache, self.cache.value_cache))  # 4.x

    def snapshot(self, live_only: bool = False) -> dict[str, torch.Tensor | int]:
        """Copies of the token ids and every layer's keys/values, keyed "layers.{i}.{keys,values}".

        `live_only` is accepted for parity with the DeepSeek states: nothing here is kept only for
        rewinding, so both views are the same.
        """
        out: dict[str, torch.Tensor | int] = {"length": self.length, "tokens": self.token_ids}
        for i, (keys, values) in enumerate(self.layer_tensors()):
            out[f"layers.{i}.keys"] = keys.clone()
            out[f"layers.{i}.values"] = values.clone()
        return out
