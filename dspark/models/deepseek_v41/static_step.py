"""A static-shape, CUDA-graph-capturable decode / verify step of DeepSeek-V4.1 over S slots.

    decoder = StaticDecoderV41(model, StaticShape(slots=8, max_context=4096, tokens=4))
    start = decoder.load(slot, state)                 # a request's state after its (exact) prefill
    ids, starts = decoder.plan(ids_host, starts_host)  # host: validate, copy to the device
    logits = decoder.step(ids, starts)                 # [S, T, V] fp32: static shapes, no host read
    out = decoder.forward(ids, starts, capture_layers=(4,))  # + final streams and layer-4 inputs

`step` feeds slot s the tokens input_ids[s] at positions starts[s] .. starts[s] + T − 1 and writes
their state (`static_state.py`): every write an `index_copy_` (or a kernel's own stores) at rows
computed on the device from positions, every read a fixed-width gather whose invisible keys are −1
(or −inf scores), so shapes and launched kernels never depend on the data and one capture per (S, T)
replays any step (`dspark.engine.graphs.StepGraph` takes this decoder as it takes V4's).

The math is the model's own modules, in `DeepseekV41ForCausalLM.forward`'s order (exact mode):
Engram hashing (the registry's `engram_rows`) and table lookups, the single-pass mHC sites of every
`Block` (`attn_site`, `enter`, `ffn_after`, `close`), the attention projections and cache
QAT, the source compressor's pooling op, the entries' RoPE + FP4 and index keys, the indexer's
queries, scores (the registry's `index_scores`) and candidate pool op, MoE and
head. Only the cache plumbing of `Attention.forward` / `publish` / `Indexer.select_batch` and of
`NgramHistory`, which read Python counters, is redone here with device-side rows.

Rollback: a slot's next start may be any position from the start of its previous step to the end
of it, as `DecodeStateV41.truncate` allows; nothing else needs resetting. Unused slots: feed them
any ids at any valid start; every slot reads only its own rows, so no other slot changes.

Host syncs: none in `step` with `KernelConfig.for_device("cuda")` (Triton MoE). The CPU reference
MoE (`MoE.forward_ref`) reads expert counts on the host: fine for the CPU tests, not capturable.
Engram tables must be on the device (`engram_tables="device"`): host tables are gathered on the CPU
from token ids the step only has on the device.

Shape symbols: S slots, T tokens per step, N = S·T rows, V vocab, k = index_topk, and those of
`static_state.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.kernels import get_op
from dspark.models.deepseek_v4.mhc import collapse
from dspark.models.deepseek_v4.side_stream import (COMPRESS, DEFAULT_LANES, KV, MIX, SideStreams, early_head_weights,
                                                   index_queries)
from dspark.models.deepseek_v4.state import check_capture
from dspark.models.deepseek_v4.static_index import StepIndex
from dspark.models.deepseek_v4.static_plan import StepPlan
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoderBase, StaticStepOutput
from dspark.models.deepseek_v41.block import initial_pre
from dspark.models.deepseek_v41.static_state import StaticSource, StaticStateV41


@dataclass
class StaticPicks:
    """What the latest index source of a static step chose, read by the layers after it (spec §5.5;
    the dynamic path's `SharedSlots` for all rows at once).

    keys        [N, W + k'] the key list holding the picks: W window rows, then the picks as rows of
                a pool view whose source entries start at `base` (−1 = none); k' = min(k, E)
    candidates  [N, E] bool, the candidate source's pool (None before it ran)
    """

    keys: torch.Tensor | None = None
    base: int = 0
    candidates: torch.Tensor | None = None


class StaticDecoderV41(StaticDecoderBase):
    """Static decode / verify steps of `model` (a `DeepseekV41ForCausalLM`) over one bucket's state."""

    def __init__(self, model, shape: StaticShape, side_streams: int = DEFAULT_LANES):
        super().__init__(model, shape, side_streams)
        self.engram_rows_op = get_op(model.kernels, "engram_rows")

    def new_state(self, model, shape: StaticShape) -> StaticStateV41:
        host = [i for i in model.engram_ids if model.layers[i].engram.embed.host]
        if host:
            raise ValueError(f"Engram layers {host} keep their tables in host memory (engram_tables='host' or "
                             "'auto'); a static step gathers table rows on the device: build the model with "
                             "engram_tables='device'")
        return StaticStateV41(model, shape)

    def index_plan(self) -> StepPlan:
        """What `static_attention` (with `publish` and `select`) asks the step's `StepIndex` for,
        layer by layer (same calls)."""
        plan = StepPlan()
        for i, layer in enumerate(self.model.layers):
            plan_attention(layer.attn, plan, self.state, i)
        return plan

    def forward(self, input_ids: torch.Tensor, starts: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> StaticStepOutput:
        """`step`, also returning the final streams and the input streams (after Engram) of
        `capture_layers` (what a drafter observes), as V4's `StaticDecoder.forward`: hidden
        [S, T, hc, D], features {layer: [S, T, hc, D]}. Capturable like `step`."""
        self._check_inputs(input_ids, starts)
        model, (n_slots, n_tok) = self.model, input_ids.shape
        capture = check_capture(capture_layers, len(model.layers))
        # Layers whose input streams a standalone post builds (Engram layers; a capture point reads the
        # fused boundary's output): as in `DeepseekV41ForCausalLM.forward` without bounded replay.
        materialised = model._materialised_inputs(None)
        index = StepIndex(starts, n_tok, self.index_tables)
        positions = index.positions  # [S, T]
        ids = input_ids.reshape(-1)  # [N]
        engram_rows, live = self._engram_rows(input_ids, positions)
        x = model.embed(ids).unsqueeze(-2).expand(-1, model.config.hc_mult, -1).contiguous()  # [N, hc, D]
        pre = initial_pre(ids.shape[0], model.config.hc_mult, model.device)
        shared, site = StaticPicks(), None  # the latest index source's picks / candidate pool, all rows
        features = {}
        # Each site's mixes on the MIX lane, joined before the next site reads them: the sublayer
        # between reads only the site's h (`side_stream` docstring). A closed block (`close`) forks
        # nothing, so a site after it needs no join.
        mixes_on = self.side.lane_fork(MIX)
        for i, layer in enumerate(model.layers):
            if layer.engram is not None:
                x = layer.engram(x, engram_rows[i], live)
            if i in capture:
                features[i] = x
            if site is None:
                site = layer.attn_site(x, pre, mixes_on)
            a = static_attention(layer.attn, site.h, index, self.state, i, shared, self.side)
            self.side.join(MIX)
            y, pending = layer.ffn_after(a, x, site, ids, mixes_on)
            pre = pending.pre
            self.side.join(MIX)
            if i + 1 < len(model.layers) and i + 1 not in materialised:
                x, site = model.layers[i + 1].enter(pending, y, mixes_on)  # post + next site: one op
            else:
                x, site = layer.close(pending, y), None
        if len(model.layers) in capture:
            features[len(model.layers)] = x
        logits = model.head(model.norm(collapse(x, pre))).float()
        per_slot = (n_slots, n_tok, *x.shape[1:])
        return StaticStepOutput(logits.view(n_slots, n_tok, -1), x.view(per_slot),
                                {i: f.view(per_slot) for i, f in features.items()})

    def _engram_rows(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Record the new tokens' compressed ids in the n-gram ring, hash every row's n-grams from
        the ring (the registry's `engram_rows`) and look the rows up: ({layer: [N, C, hd]}, live [N]
        bool or None), or ({}, None)."""
        model, c = self.model, self.model.config
        if not model.engram_ids:
            return {}, None
        columns, live = self.engram_rows_op(
            input_ids, positions, self.state.ngram.data, model.engram_token_map, model.engram_multipliers,
            model.engram_primes, model.engram_offsets, pad_id=c.engram_pad_id, image_token_id=c.image_token_id)
        rows = {layer: model.layers[layer].engram.embed.lookup(columns[:, j], model.device)
                for j, layer in enumerate(model.engram_ids)}
        return rows, live


def static_attention(attn, x: torch.Tensor, index: StepIndex, state: StaticStateV41, layer: int,
                     shared: StaticPicks, side: SideStreams | None = None) -> torch.Tensor:
    """CSA2 `Attention.forward` on the static state: x [N, D] (after attn_norm) at the step's
    positions (`index`, [S, T]) -> [N, D].

    Writes the new window latents (and, on a KV source, its rows, entries and index keys) first; an
    index source then picks for the layers after it (`shared`: its key list and candidate pool); the
    key list is [W window rows | the latest picks in the KV source's entries] as rows of the pool from
    the layer's window on, −1 = none. It is the step's planned list (`StepIndex.csa_keys`, window rows
    filled): the selection kernel writes the picks into it already offset, and a layer sharing them
    reads the same list, its picks shifted in place by the difference of the two layers' pool views
    (two launches, where a cat and an offset took four).
    A KV source's publishing and the window latents need only x, the indexer's queries only x and c_q:
    with `side` they run on its lanes beside the q projection (`deepseek_v4.side_stream`), each joined
    before the first read of what it writes.
    """
    cos, sin = index.cos_sin(attn.rope)  # [N, rd/2] fp32
    side = side or SideStreams(x.device, 0)
    publishes = attn.ratio and attn.compressor is not None
    if publishes:
        with side.fork(COMPRESS):
            publish(attn, x, index, state.sources[attn.role.kv_source])
    window = state.windows[layer]
    with side.fork(KV):
        kv = attn.project_kv(x, cos, sin)
        # the window cache is FP8 (QAT): rounded into its ring rows by one launch
        attn.quant.window_rows(kv, window.flat(), index.ring_rows(window).reshape(-1))
        weights = early_head_weights(attn.indexer, x)
    q_lora = attn.project_q_lora(x)
    if attn.indexer is not None:  # the indexer's queries beside the heads' (the lane waits for c_q)
        with side.fork(KV):
            queries = index_queries(attn.indexer, x, q_lora, cos, sin, weights)
    q = attn.project_q_heads(q_lora, cos, sin)
    # The attention reads the pool from the layer's window on (`pool_from`): the window keys are rows of
    # its ring as they are, and the entries (after every window) rows past it: no per-layer offset ops.
    pool_from = state.window_offsets[layer]
    if not attn.ratio:
        keys = index.window_keys(attn.window, window)  # [N, W] rows of the layer's ring, −1 = none
    else:
        source = state.sources[attn.role.kv_source]
        if publishes:
            side.join(COMPRESS)
        if attn.indexer is not None:
            side.join(KV)
            keys = index.csa_keys(attn.window, window, pick_width(attn.indexer, source))
            base = source.offset - pool_from
            select(attn.indexer, *queries, index, source, shared, keys[:, attn.window:], base)
            shared.keys, shared.base = keys, base
        else:
            keys = shared_keys(shared, attn.window, source.offset - pool_from)
    side.join(KV)
    out = attn.attend_op(q, state.pool[pool_from:], keys, attn.attn_sink, attn.scale)  # [N, H, d]
    return attn.project_out(out, cos, sin)


def pick_width(indexer, source: StaticSource) -> int:
    """k' = min(k, E): the columns of an index source's picks over `source`'s entries."""
    return min(indexer.topk, source.n_entries)


def shared_keys(shared: StaticPicks, window: int, base: int) -> torch.Tensor:
    """The key list [N, W + k'] of a layer reading the latest index source's picks in a pool view whose
    source entries start at `base`: the source's own list (every layer has the same window and ring
    size, so the same window rows), its picks shifted in place by base − shared.base where not −1."""
    if base != shared.base:
        picks = shared.keys[:, window:]
        picks.add_(picks >= 0, alpha=base - shared.base)
        shared.base = base
    return shared.keys


def plan_attention(attn, plan: StepPlan, state: StaticStateV41, layer: int) -> None:
    """The `StepIndex` calls of `static_attention`, `publish` and `select` for one layer, on `plan`."""
    plan.cos_sin(attn.rope)
    plan.ring_rows(state.windows[layer])
    if not attn.ratio:
        plan.window_keys(attn.window, state.windows[layer])
        return
    source = state.sources[attn.role.kv_source]
    if attn.compressor is not None:
        m = source.rate
        if m == 1:
            plan.entry_rows(1, source.n_entries)
        else:
            plan.ring_rows(source.kv)
            plan.pool_index(m, False, source.kv)  # `group_rows` without overlap: these rows
            plan.entry_rows(m, source.n_entries)
        plan.group_cos_sin(attn.rope, m)
    if attn.indexer is not None:
        plan.visible(attn.indexer.ratio)
        plan.csa_keys(attn.window, state.windows[layer], pick_width(attn.indexer, source))
        plan.entry_offsets(source.offset - state.window_offsets[layer], source.n_entries)


def publish(attn, x: torch.Tensor, index: StepIndex, source: StaticSource) -> None:
    """`Attention.publish` on the static state (KV source, spec §5.2-§5.3): write the rows of the
    step's positions (ratio > 1), then the entries and index keys of every candidate group the step
    can complete; incomplete candidates go to the trash row (same writes every step, whatever the data).
    Candidates: ratio 1, every new token; ratio m > 1, groups start // m .. + ceil(T/m) − 1 (the
    groups whose last position may fall in the step), pooled from the rings.
    """
    m = source.rate
    compressor = attn.compressor
    if m == 1:
        latents, _ = compressor.project(x)  # [N, d]
        rows = index.entry_rows(1, source.n_entries)
    else:  # fp32 rows [N, d] stored into the kv and gate rings (same size) by the projection itself
        compressor.project(x, (source.kv.flat(), source.gate.flat()), index.ring_rows(source.kv).reshape(-1))
        group, _, _ = index.group_rows(m, False, source.kv)  # [S, c, m]
        kv_groups = source.kv.flat()[group].flatten(0, 1)  # [S·c, m, d]
        gate_groups = source.gate.flat()[group].flatten(0, 1)
        latents = compressor.pool_op(kv_groups, gate_groups, compressor.norm.weight, eps=compressor.norm.eps,
                                     out_dtype=x.dtype)  # [S·c, d]
        rows = index.entry_rows(m, source.n_entries)
    # Entry w stands for position w·m; keys come from the latent before its rotation.
    cos, sin = index.group_cos_sin(attn.rope, m)  # [S·c, rd/2]; ratio 1: the positions themselves
    entries = attn.quant.entries(attn.rope_op(latents, cos, sin))
    source.write_entries(rows, entries, attn.indexer.keys(latents, cos, sin))


def select(indexer, q: torch.Tensor, weights: torch.Tensor, index: StepIndex, source: StaticSource,
           shared: StaticPicks, out: torch.Tensor, base: int) -> None:
    """`Indexer.select_batch` on the static state: every row scores all E index keys of its slot;
    entries it cannot see yet (w >= (p+1)//m), or outside the candidate pool on a later index source,
    are −inf and never picked. Writes the picks into out [N, min(k, E)] (ascending, −1 = none) as
    rows of a pool view whose `source` entries start at `base` (the selection kernel adds the planned
    per-slot entry offsets), and, on the candidate source, sets shared.candidates [N, E] (the
    registry's `indexer_pool`). q [N, Hi, di], weights [N, Hi].
    """
    n_slots, n_tok = index.positions.shape
    keys = source.keys[:n_slots, : source.n_entries]  # [b, E, di] the bucket's slots
    args = (q.view(n_slots, n_tok, *q.shape[1:]), weights.view(n_slots, n_tok, -1), keys, index.visible(indexer.ratio))
    bscores = None  # the pool's block scores [N, ceil(E / b)] when the scores kernel wrote them
    if indexer.pooled_scores_op is not None:  # candidate source, `index_scores_pooled` picked
        scores, bscores = indexer.pooled_scores_op(*args, block=indexer.candidate_block_size)
        bscores = bscores.flatten(0, 1)
    else:
        scores = indexer.scores_op(*args)
    scores = scores.flatten(0, 1)  # [N, E] fp32, −inf if not complete
    if indexer.uses_candidates and not indexer.is_candidate_source:
        scores = scores.masked_fill(~shared.candidates, float("-inf"))
    indexer.topk_op(scores, indexer.topk, offset=index.entry_offsets(base, source.n_entries), out=out)
    if indexer.is_candidate_source:  # its own top-k ignores the pool it publishes (spec §5.3 step 5)
        visible = (index.flat + 1) // indexer.ratio  # [N]
        shared.candidates = indexer.pool_op(scores, visible, topk_blocks=indexer.candidate_blocks,
                                            block=indexer.candidate_block_size, bscores=bscores)
