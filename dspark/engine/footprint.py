"""How much decode state one request holds at a given length, per kind of state (host-side, no torch).

The page allocator (`dspark.engine.pages`) charges every request for what its target state and its
draft state hold. Those hold rows of a few kinds, each growing in one of two ways:

    kind                 where (V4 / V4.1)                                  rows at length L after a call of f tokens
    token_ids            every token fed (hash routing, Engram)             L
    window_kv            per layer, latents of the sliding window           min(L, W − 1 + f)
    compressed_kv        per CSA / HCA layer (V4.1: per KV source), rate m  L // m
    indexer_keys         per CSA layer (V4.1: per KV source), rate m        L // m
    compressor_buffers   per compressor, per-token rows still to be pooled  min(L, (1 + overlap)·m − 1 + f)
    engram_ids           V4.1 Engram look-back                              min(L, N − 1 + f)
    kv_cache             transformers targets: K and V of every layer       L
    drafter_context      DSpark: per stage, last W committed keys           min(L, W)
                         MTP: its window layer (+ its token ids)            as window_kv / token_ids

A "row" of a kind is that kind's values for one position summed over every layer that holds it, so
all of a kind's rows grow together and one page holds a whole number of them. Bounded kinds are
upper bounds of what the state keeps (the window pruned at the start of a call keeps W − 1 older
latents plus the call's f new ones). Amortised growth of the device buffers (`Rows` doubles its
capacity) is not charged: the budget counts live rows, which is what a paged device pool would
hold. The n-gram drafter's history is a Python list on the host and is not charged.

Shape symbols: L tokens fed so far (length after the call), f tokens fed by the call, W window,
m compression rate, N Engram n-gram size.
"""

from __future__ import annotations

from dataclasses import dataclass

_FP32 = 4
_ID = 8  # torch.long


@dataclass(frozen=True)
class StateKind:
    """One kind of per-request state.

    name : what it is (one of the kinds in the module docstring).
    row_bytes : bytes of one row, summed over the layers that hold it.
    rate : rows grow as L // rate (unbounded kinds; bound is None).
    bound : rows kept before a call's new ones (bounded kinds): rows = min(L, bound + f).
    grows_with_call : whether the call's f new rows count on top of `bound` (False for state that
        only ever holds committed rows, e.g. the DSpark draft context).
    """

    name: str
    row_bytes: int
    rate: int = 1
    bound: int | None = None
    grows_with_call: bool = True

    def __post_init__(self):
        if isinstance(self.row_bytes, bool) or not isinstance(self.row_bytes, int) or self.row_bytes < 1:
            raise ValueError(f"{self.name}: row_bytes must be a positive int, got {self.row_bytes!r}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, int) or self.rate < 1:
            raise ValueError(f"{self.name}: rate must be a positive int, got {self.rate!r}")
        if self.bound is not None and (not isinstance(self.bound, int) or self.bound < 0):
            raise ValueError(f"{self.name}: bound must be None or an int >= 0, got {self.bound!r}")

    def rows(self, length: int, fed: int = 0) -> int:
        """Rows held at `length` tokens right after a call that fed `fed` of them."""
        if self.bound is None:
            return length // self.rate
        return min(length, self.bound + (fed if self.grows_with_call else 0))


@dataclass(frozen=True)
class StateFootprint:
    """Every kind of state one request of a (target, drafter) pair holds."""

    kinds: tuple[StateKind, ...]

    def rows(self, length: int, fed: int = 0) -> tuple[int, ...]:
        """Rows per kind at `length` right after a call of `fed` tokens."""
        return tuple(k.rows(length, fed) for k in self.kinds)

    def bytes(self, length: int, fed: int = 0) -> int:
        return sum(k.row_bytes * n for k, n in zip(self.kinds, self.rows(length, fed)))

    @property
    def max_row_bytes(self) -> int:
        return max(k.row_bytes for k in self.kinds)


def target_footprint(config, itemsize: int) -> tuple[StateKind, ...]:
    """State kinds of one DeepSeek-V4, V4.1 or transformers-target request; `config` the model
    config, `itemsize` the bytes of one element in the model dtype (fp32 compressor scores are 4
    bytes regardless)."""
    if hasattr(config, "kv_values_per_token"):  # a transformers causal LM: token ids + its KV cache
        return (StateKind("token_ids", _ID), StateKind("kv_cache", config.kv_values_per_token * itemsize))
    if hasattr(config, "kv_source_layer_ids"):
        return _v41_kinds(config, itemsize)
    return _v4_kinds(config, itemsize)


def _v4_kinds(c, itemsize: int) -> tuple[StateKind, ...]:
    kinds = [StateKind("token_ids", _ID),
             StateKind("window_kv", c.num_hidden_layers * c.head_dim * itemsize, bound=c.sliding_window - 1)]
    for layer_type, rate in sorted(c.compress_rates.items()):
        n = sum(t == layer_type for t in c.layer_types)
        if n == 0:
            continue
        overlap = layer_type == "compressed_sparse_attention"  # CSA pools overlapping windows, HCA does not
        width = (2 if overlap else 1) * c.head_dim
        kinds.append(StateKind("compressed_kv", n * c.head_dim * itemsize, rate=rate))
        # per-token rows: C in the model dtype, Z + ape in fp32
        kinds.append(StateKind("compressor_buffers", n * width * (itemsize + _FP32),
                               bound=(2 if overlap else 1) * rate - 1))
        if overlap:  # the lightning indexer: its own overlapping compressor, entries are the keys
            kinds.append(StateKind("indexer_keys", n * c.index_head_dim * itemsize, rate=rate))
            kinds.append(StateKind("compressor_buffers", n * 2 * c.index_head_dim * (itemsize + _FP32),
                                   bound=2 * rate - 1))
    return tuple(kinds)


def _v41_kinds(c, itemsize: int) -> tuple[StateKind, ...]:
    kinds = [StateKind("token_ids", _ID),
             StateKind("window_kv", c.num_hidden_layers * c.head_dim * itemsize, bound=c.sliding_window - 1)]
    rates = sorted({c.compress_ratios[i] for i in c.kv_source_layer_ids})
    for rate in rates:
        n = sum(c.compress_ratios[i] == rate for i in c.kv_source_layer_ids)
        kinds.append(StateKind("compressed_kv", n * c.head_dim * itemsize, rate=rate))
        kinds.append(StateKind("indexer_keys", n * c.index_head_dim * itemsize, rate=rate))
        if rate > 1:  # kv and gate rows of the incomplete group, fp32
            kinds.append(StateKind("compressor_buffers", n * 2 * c.head_dim * _FP32, bound=rate - 1))
    if getattr(c, "engram_layer_ids", None):
        kinds.append(StateKind("engram_ids", _ID, bound=c.engram_max_ngram_size - 1))
    return tuple(kinds)


def drafter_footprint(drafter, itemsize: int) -> tuple[StateKind, ...]:
    """State kinds of one request's draft state, all named "drafter_context".

    DSpark: per stage the keys of the last W committed rows. MTP: one sliding-window layer plus its
    token ids and one pending [n_hc, D] row. n-gram (host list) and None: nothing on the device. A
    custom drafter may describe itself with a `state_kinds(itemsize)` method; otherwise it is
    charged nothing.
    """
    from dspark.draft.drafter import DSparkDrafter  # drafter classes import torch; keep this module light
    from dspark.draft.mtp import MtpDrafter

    if drafter is None:
        return ()
    if hasattr(drafter, "state_kinds"):
        return tuple(drafter.state_kinds(itemsize))
    if isinstance(drafter, DSparkDrafter):
        return (StateKind("drafter_context", drafter.config.num_stages * drafter.model.head_dim * itemsize,
                          bound=drafter.window, grows_with_call=False),)
    if isinstance(drafter, MtpDrafter):
        c = drafter.target.config
        return (StateKind("drafter_context", _ID),
                StateKind("drafter_context", c.head_dim * itemsize, bound=c.sliding_window - 1),
                StateKind("drafter_context", c.hc_mult * c.hidden_size * itemsize, bound=1, grows_with_call=False))
    return ()


def request_footprint(model, drafter) -> StateFootprint:
    """The footprint of one request of `model` (DeepSeek-V4 or V4.1) drafted by `drafter`."""
    itemsize = model.dtype.itemsize
    return StateFootprint(target_footprint(model.config, itemsize) + drafter_footprint(drafter, itemsize))
