"""A static-shape, CUDA-graph-capturable decode / verify step of DeepSeek-V4 over S slots.

    decoder = StaticDecoder(model, StaticShape(slots=8, max_context=4096, tokens=4))
    start = decoder.load(slot, state)                 # a request's state after its (dynamic) prefill
    ids, starts = decoder.plan(ids_host, starts_host)  # host: validate, copy to the device
    logits = decoder.step(ids, starts)                 # [S, T, V] fp32: static shapes, no host read
    out = decoder.forward(ids, starts, capture_layers=(2,))  # + final streams and layer-2 inputs

`step` feeds slot s the tokens input_ids[s] at positions starts[s] .. starts[s] + T − 1 and writes
their state (`static_state.py`); every write lands at rows computed on the device from the positions
(an `index_copy_`, or the store of the op that produces the rows: the window latents' norm + RoPE,
and at one decode row the compressor projection), every read a fixed-width gather whose invisible
keys are −1, so the shapes and the launched kernels never depend on the data and the whole call can
be captured once per (b, T) and replayed. A step may run on a bucket of the first b <= S slots (ids
[b, T], starts [b]): it touches only their rows, so slots >= b keep their state unchanged. The math
is the model's own modules (projections, RoPE, compressor pooling, indexer scores, registry ops, mHC,
MoE, norms, head); only the cache plumbing of `Attention.forward` and `Compressor.update_batch`,
which reads Python counters, is redone here with device-side indices.

Rollback: a slot's next start may be any position from the start of its previous step to the end
of it (accepted tokens), exactly as `DecodeState.truncate` allows; nothing else needs resetting.
Unused slots of a bucket: feed them a slot that holds no live request (any ids, start 0); every
slot reads only its own rows, so they change no other slot's result.

Host syncs: none in `step` when the model's `KernelConfig` is the Triton one. The torch reference
MoE (`MoE.forward_ref`) reads expert counts on the host (`.tolist()`): fine on the CPU, where the
step is tested against the dynamic path, but not capturable; a CUDA model built with
`KernelConfig.for_device("cuda")` runs `moe_route` + `moe_experts`, which size everything from shapes.

Shape symbols: S slots, T tokens per step, N = S·T rows, V vocab, and those of `static_state.py`.
"""

from __future__ import annotations

import abc

from dataclasses import dataclass, field

import torch

from dspark.models.deepseek_v4.side_stream import (COMPRESS, DEFAULT_LANES, KV, MIX, SideStreams, check_lanes,
                                                   early_head_weights, index_queries)
from dspark.models.deepseek_v4.state import check_capture
from dspark.models.deepseek_v4.static_index import StepIndex, StepTables
from dspark.models.deepseek_v4.static_plan import StepPlan
from dspark.models.deepseek_v4.static_state import StaticCompressorState, StaticLayerState, StaticShape, StaticState


@dataclass
class StaticStepOutput:
    """One static step's result, per slot and token (the static counterpart of `DeepseekV4Output`).

    logits   fp32 [S, T, V]
    hidden   [S, T, n_hc, D] final residual streams before the HC head (the MTP block's input)
    features {layer id: [S, T, n_hc, D]} input streams of each captured layer (id = num_hidden_layers:
             the final streams)
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    features: dict[int, torch.Tensor] = field(default_factory=dict)


class StaticDecoderBase(abc.ABC):
    """What every family's static decoder shares: the bucket's shape and state, `load`, the host-side
    `plan` and `step`; a subclass builds its state (`new_state`) and runs `forward`.

    side_streams: CUDA streams beside the step's own (`side_stream.SideStreams`: the same results):
    3 runs each mHC site's mixes on a third, beside the sublayer;
    2 runs each layer's compressors on one and its kv projection on the other, beside its q
    projection; 1 the compressors alone; 0 the single-stream step (default
    `side_stream.DEFAULT_LANES`, 3). `self.side_streams` is the count in use: 0 where the step index is
    not planned (`KernelConfig.step_index="ref"`), whose tensors are built on first use, on whichever
    stream asks first, where another stream could read them before its join.
    """

    def __init__(self, model, shape: StaticShape, side_streams: int = DEFAULT_LANES):
        if not isinstance(shape, StaticShape):
            raise ValueError(f"shape must be a StaticShape, got {shape!r}")
        check_lanes(side_streams)  # before anything is built
        self.model = model
        self.shape = shape
        self.state = self.new_state(model, shape)
        # The steps' constant index tensors (RoPE tables per group of equal ropes, ranges, the
        # segments of the step-index op), made here: never inside a captured step.
        self.index_tables = StepTables(model, shape, self.index_plan())
        self.side_streams = side_streams if self.index_tables.planned else 0
        self.side = SideStreams(model.device, self.side_streams)

    @abc.abstractmethod
    def new_state(self, model, shape: StaticShape):
        """The family's fixed-size state for `shape` (slots, capacity, tokens per step)."""

    def index_plan(self) -> StepPlan | None:
        """The `StepIndex` requests of every step (a `StepPlan`), built in one `step_index` launch;
        None: each is built by torch ops on first use."""
        return None

    def load(self, slot: int, state) -> int:
        """Copy a request's dynamic decode state into `slot`; returns the slot's next start position."""
        return self.state.load(slot, state)

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request (a device copy of its rows; between steps)."""
        self.state.move(src, dst)

    def plan(self, input_ids, starts) -> tuple[torch.Tensor, torch.Tensor]:
        """Host side of a step: validate host values (ids [S, T], starts [S]; lists or CPU tensors)
        and copy them to the model's device. Returns (input_ids [S, T] long, starts [S] long)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        starts = torch.as_tensor(starts, dtype=torch.long)
        self._check_shapes(ids, starts)
        vocab = self.model.config.vocab_size
        bad_ids = ((ids < 0) | (ids >= vocab)).nonzero()
        if bad_ids.numel():
            s, t = bad_ids[0].tolist()
            raise ValueError(f"input_ids[{s}, {t}]={int(ids[s, t])} outside [0, {vocab})")
        ends = starts + ids.shape[1]
        bad = ((starts < 0) | (ends > self.shape.max_context)).nonzero().flatten()
        if bad.numel():
            s = int(bad[0])
            raise ValueError(f"starts[{s}]={int(starts[s])}: positions {int(starts[s])}..{int(ends[s]) - 1} "
                             f"outside the capacity [0, max_context={self.shape.max_context})")
        device = self.model.device
        return ids.to(device, non_blocking=True), starts.to(device, non_blocking=True)

    def step(self, input_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Feed slot s the tokens input_ids[s] at positions starts[s] + 0 .. T − 1; returns logits.

        input_ids [S, T] long, starts [S] long, both on the model's device (their values are trusted:
        `plan` checks them on the host; reading them here would sync). Returns fp32 [S, T, V].
        Capturable: only shapes are read on the host.
        """
        return self.forward(input_ids, starts).logits

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, starts: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> StaticStepOutput:
        """One step: logits, final streams and captured features (`StaticStepOutput`)."""

    def _check_inputs(self, input_ids: torch.Tensor, starts: torch.Tensor) -> None:
        """Shapes, dtypes and device of a step's inputs (never their values: that would sync)."""
        self._check_shapes(input_ids, starts)
        if input_ids.device != self.model.device or starts.device != self.model.device:
            raise ValueError(f"input_ids ({input_ids.device}) and starts ({starts.device}) must be on the "
                             f"model's device {self.model.device}")

    def _check_shapes(self, input_ids: torch.Tensor, starts: torch.Tensor) -> None:
        """ids [b, T] and starts [b]: a bucket of the first b <= S slots."""
        s, t_max = self.shape.slots, self.shape.tokens
        if input_ids.dim() != 2 or not 1 <= input_ids.shape[0] <= s or not 1 <= input_ids.shape[1] <= t_max \
                or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a long [b<={s}, T<={t_max}] tensor, got "
                             f"{tuple(input_ids.shape)} {input_ids.dtype}")
        if tuple(starts.shape) != input_ids.shape[:1] or starts.dtype != torch.long:
            raise ValueError(f"starts must be a long [b={input_ids.shape[0]}] tensor, got {tuple(starts.shape)} "
                             f"{starts.dtype}")


class StaticDecoder(StaticDecoderBase):
    """Static decode / verify steps of `model` (a `DeepseekV4ForCausalLM`) over one bucket's state."""

    def new_state(self, model, shape: StaticShape) -> StaticState:
        return StaticState(model, shape)

    def index_plan(self) -> StepPlan:
        """What `static_attention` asks the step's `StepIndex` for, layer by layer (same calls)."""
        plan = StepPlan()
        for layer, state in zip(self.model.layers, self.state.layers):
            plan_attention(layer.attn, plan, state)
        return plan

    def forward(self, input_ids: torch.Tensor, starts: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> StaticStepOutput:
        """`step`, also returning the final streams and the input streams of `capture_layers` (what a
        drafter observes), all with static shapes: see `StaticStepOutput`. Capturable like `step`."""
        self._check_inputs(input_ids, starts)
        model, (n_slots, n_tok) = self.model, input_ids.shape
        capture = check_capture(capture_layers, len(model.layers))
        index = StepIndex(starts, n_tok, self.index_tables)  # positions [S, T] and every planned index
        ids = input_ids.reshape(-1)  # [N]
        x = model.embed(ids)
        x = x.unsqueeze(-2).expand(-1, model.config.hc_mult, -1).contiguous()  # [N, n_hc, D]
        features = {}
        # The block loop of `DeepseekV4ForCausalLM.forward`, with the static attention in each block.
        # Each site's post and comb on the MIX lane, joined before the next site reads them: the
        # sublayer between reads only the site's h (`side_stream` docstring).
        mixes_on = self.side.lane_fork(MIX)
        site = model.layers[0].attn_site(x, mixes_on)
        for i, layer in enumerate(model.layers):
            if i in capture:
                features[i] = x
            a = static_attention(layer.attn, site.h, index, self.state.layers[i], self.side)  # h: after attn_norm
            self.side.join(MIX)
            y, pending = layer.ffn_after(a, x, site, ids, mixes_on)
            self.side.join(MIX)
            if i + 1 < len(model.layers):
                x, site = model.layers[i + 1].enter(pending, y, mixes_on)
            else:
                x = layer.close(pending, y)
        if len(model.layers) in capture:
            features[len(model.layers)] = x
        per_slot = (n_slots, n_tok, *x.shape[1:])
        return StaticStepOutput(model._logits(model.collapse(x)).view(n_slots, n_tok, -1), x.view(per_slot),
                                {i: f.view(per_slot) for i, f in features.items()})



def static_attention(attn, x: torch.Tensor, index: StepIndex, state: StaticLayerState,
                     side: SideStreams | None = None) -> torch.Tensor:
    """`Attention.forward` on the static state: x [N, D] (after attn_norm) at the step's positions
    (`index`, [S, T]) -> [N, D].

    Writes the new window latents, compressor rows and completed entries of every slot first, then
    attends over the fixed-width key list [W | top-k picks (CSA) or all E entries (HCA)], −1 = none.
    The compressors and the kv projection need only x, the indexer's queries only x and c_q: with
    `side` they run on its lanes beside the q projection, each joined before the first read of what
    it writes.
    """
    cos, sin = index.cos_sin(attn.rope)  # [N, rd/2] fp32
    side = side or SideStreams(x.device, 0)
    if attn.compressor is not None:
        with side.fork(COMPRESS):
            update_compressor(attn.compressor, state.compressor, index, x, attn.rope)
            if attn.indexer is not None:
                update_compressor(attn.indexer.compressor, state.indexer, index, x, attn.rope)
    with side.fork(KV):  # the new window latents go straight to their ring rows from the norm + RoPE op
        attn.project_kv(x, cos, sin, kv_out=state.window.flat(), kv_rows=index.ring_rows(state.window).reshape(-1))
        weights = early_head_weights(attn.indexer, x)
    q_lora = attn.project_q_lora(x)
    if attn.indexer is not None:  # the indexer's queries beside the heads' (the lane waits for c_q)
        with side.fork(KV):
            q_index, weights = index_queries(attn.indexer, x, q_lora, cos, sin, weights)
    fold = attn.attend_qnorm_op is not None and attn.attend_qnorm_op.folds(x.shape[0], attn.n_heads, attn.head_dim)
    if fold:  # raw heads: the attention op normalises and rotates them (`LatentAttention.attend_qnorm_op`)
        q = attn.wq_b(q_lora).unflatten(-1, (attn.n_heads, attn.head_dim))
    else:
        q = attn.project_q_heads(q_lora, cos, sin)
    if attn.compressor is None:  # SWA: the window alone
        keys = index.window_keys(attn.window, state.window)  # [N, W]
    else:
        first, n_entries = state.window.slots * state.window.size, state.compressor.n_entries
        if attn.indexer is not None:  # CSA: the indexer's top-k of the complete entries
            side.join(KV)
            side.join(COMPRESS)
            keys = index.csa_keys(attn.window, state.window, min(attn.indexer.topk, n_entries))
            select_entries(attn.indexer, q_index, weights, state.indexer, index,
                           offset=index.entry_offsets(first, n_entries), out=keys[:, attn.window:])
        else:  # HCA: every complete entry (one key list for all HCA layers of the step)
            side.join(COMPRESS)
            keys = index.hca_keys(attn.window, state.window, attn.rate, n_entries, first)
    side.join(KV)
    if fold:
        out = attn.attend_qnorm_op(q, cos, sin, state.pool, keys, attn.attn_sink, attn.scale, eps=attn.eps)
    else:
        out = attn.attend_op(q, state.pool, keys, attn.attn_sink, attn.scale)  # [N, H, d]
    return attn.project_out(out, cos, sin)


def plan_attention(attn, plan: StepPlan, state: StaticLayerState) -> None:
    """The `StepIndex` calls of `static_attention` and `update_compressor` for one layer, on `plan`
    (the non-fused pool's group rows stay torch builds: the reference path)."""
    plan.cos_sin(attn.rope)
    plan.ring_rows(state.window)
    if attn.compressor is None:
        plan.window_keys(attn.window, state.window)
        return
    first, n_entries = state.window.slots * state.window.size, state.compressor.n_entries
    parts = [(attn.compressor, state.compressor)]
    if attn.indexer is not None:
        parts.append((attn.indexer.compressor, state.indexer))
        plan.csa_keys(attn.window, state.window, min(attn.indexer.topk, n_entries))
        plan.entry_offsets(first, n_entries)
        plan.visible(attn.indexer.rate)
    else:
        plan.hca_keys(attn.window, state.window, attn.rate, n_entries, first)
    for compressor, part in parts:
        plan.ring_rows(part.kv)
        plan.phase(compressor.rate)
        plan.group_cos_sin(attn.rope, compressor.rate)
        plan.entry_rows(compressor.rate, part.n_entries)
        if compressor.pools_from_rows:
            plan.pool_index(compressor.rate, part.overlap, part.kv)
        else:
            plan.group_starts(compressor.rate)


def update_compressor(compressor, state: StaticCompressorState, index: StepIndex, x: torch.Tensor, rope) -> None:
    """`Compressor.update_batch` on the static state: project x [N, D] (after attn_norm) into the rows
    of the step's positions in the kv and score rings (`Compressor.project_rows`: at one decode row
    the projection kernel stores them), then pool the ceil(T/m) groups a step can complete and write
    each entry at its slot (groups not complete yet go to the trash row E: the same count every step,
    whatever the data).
    With the fused `compressor_pool_gather` the pool reads its slots straight from the rings
    (`StepIndex.pool_index`) and stores each rotated entry at its row; otherwise they are gathered
    into [S·c, slots, d_c] copies first and the entries copied to their rows after.
    """
    m = compressor.rate
    rows = index.ring_rows(state.kv).reshape(-1)  # [N]; the kv and score rings have the same size
    compressor.project_rows(x, index.phase(m), state.kv.flat(), state.score.flat(), rows)
    cos_sin = index.group_cos_sin(rope, m)
    entry_rows = index.entry_rows(m, state.n_entries)  # [S·c]
    if compressor.pools_from_rows:
        compressor.pool_rows(state.kv.flat().view(-1, state.dim), state.score.flat().view(-1, state.dim),
                             index.pool_index(m, state.overlap, state.kv), cos_sin, state.entries.view(-1, state.dim),
                             entry_rows)
        return
    kv_slots, score_slots = _candidate_slots(state, index, m)  # [S·c, slots, d_c]
    entries = compressor.pool(kv_slots, score_slots, index.group_starts(m), rope, cos_sin)
    state.entries.view(-1, state.dim).index_copy_(0, entry_rows, entries)


def _candidate_slots(state: StaticCompressorState, index: StepIndex, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooling slots of the step's candidate groups from the rings: [S·c, slots, d_c] each (kv,
    score); a missing group (−1) is value 0, logit −inf (`StepIndex.group_rows`)."""
    rows, half, missing = index.group_rows(m, state.overlap, state.kv)
    coff = 2 if state.overlap else 1
    kv = state.kv.flat().view(-1, coff, state.dim)[rows, half]  # [S, c, slots, d_c]
    score = state.score.flat().view(-1, coff, state.dim)[rows, half]
    kv = kv.masked_fill(missing, 0)
    score = score.masked_fill(missing, float("-inf"))
    return kv.flatten(0, 1), score.flatten(0, 1)


def select_entries(indexer, q: torch.Tensor, weights: torch.Tensor, state: StaticCompressorState,
                   index: StepIndex, *, offset: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """`Indexer.select` on the static state: every row scores all E index keys of its slot (one
    `index_scores` call for the bucket), entries it cannot see yet (w >= (p+1)//m) score −inf and come
    out as −1 picks.

    q [N, Hi, di], weights [N, Hi] -> [N, min(k, E)] long entry ids, ascending; with `offset` [N, 1]
    the ids are pool rows (entry id + offset, −1 kept) and with `out` they are stored there
    (`select_topk`'s arguments: the selection kernel writes the key list itself).
    """
    n_slots, n_tok = index.positions.shape
    keys = state.entries[:n_slots, : state.n_entries]  # [b, E, di] the bucket's slots (a strided view)
    scores = indexer.scores_op(q.view(n_slots, n_tok, *q.shape[1:]), weights.view(n_slots, n_tok, -1), keys,
                               index.visible(indexer.rate))  # [b, T, E]
    return indexer.topk_op(scores.flatten(0, 1), indexer.topk, offset=offset, out=out)
