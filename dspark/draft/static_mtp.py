"""A static-shape, CUDA-graph-capturable MTP `observe` / `propose` over S slots (`MtpDrafter`'s static path).

    static = StaticMtpDrafter(drafter, StaticShape(slots=8, max_context=4096, tokens=2))
    next_anchor = static.load(slot, dstate)          # a request's `MtpState` after its (dynamic) prefill
    static.observe(hidden, starts, ids)              # a verify step's rows of every slot
    anchors, positions, temps = static.plan(anchors_host, positions_host, temps_host)   # host: validate, copy
    proposal = static.propose(anchors, positions, temps)                                # no host read

The MTP block (deepseek_v4 spec §12) is one sliding-window layer; pair (X_p, tok_{p+1}) of the
target's final streams at position p and the token after it sits at MTP position p (`mtp.py`). Per
slot the state is

    the block's window latents       `StaticState` of the one layer (static_state.py), by MTP position
    the target's final streams X_p   ring [S, T + 1, n_hc, D] by target position p

`observe` of a verify step at target start s (tokens tok_s .. tok_{s+t−1}, streams X_s .. X_{s+t−1})
writes the pairs (X_{s−1+j}, tok_{s+j}), j = 0 .. t − 1, at MTP positions s − 1 .. s + t − 2 (X_{s−1}
from the streams ring, where the previous step or `load` put it) and stores X_s .. X_{s+t−1}. A layer's
decode state is its window latents only, so `observe` runs the block up to them (inputs, mHC pre,
attn_norm, wkv, kv_norm + RoPE) and skips the attention, MoE and head whose outputs it would drop.
As with the target, nothing records which rows are committed: after a round that accepted a drafts
the next anchor sits at L' = s + a + 1, whose pair is at MTP position L' − 1; the pairs past it
(rejected drafts, padding) are hidden from every query at or before it and overwritten later, and
X_{L'−1} is in the streams ring (T + 1 rows keep it through the next step's T writes).

`propose` from anchor a at target position L runs the pair (X_{L−1}, a) at MTP position L − 1 and,
for a block of k > 1, chains on the block's own output streams and its previous draft at L, L + 1, ..
(`MtpDrafter.propose`). Each link writes its own window latent at its position before attending (the
static attention reads keys from the ring); that is harmless: the next `observe` starts at L − 1 and
writes the same pair there, and a query never sees positions past its own. Free slots of a bucket
(anchor position 0) read and write only their own rows (MTP position clamped at 0).

Sampling: per-slot temperatures, the exponential race of `static_chain.pick_static` with
counter-based noise keyed by each slot's request (the target's `slot_noise` op; greedy rows: argmax, no q; sampled rows:
q = softmax(logits / t), as the dynamic `MtpDrafter.propose`, which ignores top-p / top-k too). Without a confidence head every draft
reports the drafter's constant `confidence`; `confidence_logits` is None.

Host syncs: none in `observe` / `propose` when the target's `KernelConfig` is the Triton one (the
reference MoE on the CPU reads expert counts on the host: not capturable, fine for tests).

Shape symbols: S slots, b a call's bucket, T rows per observe at most, t this call's, k block size,
V vocabulary, n_hc streams, D hidden size.
"""

from __future__ import annotations

import torch

from dspark.draft.base import DraftProposal
from dspark.draft.mtp import MtpDrafter, MtpState
from dspark.draft.static_chain import pick_static, row_temperatures
from dspark.draft.dspark_v4 import target_kernels
from dspark.draft.static_drafter import plan_propose
from dspark.kernels import KernelConfig, get_op
from dspark.models.deepseek_v4.static_index import StepIndex, StepTables
from dspark.models.deepseek_v4.static_plan import StepPlan
from dspark.models.deepseek_v4.static_state import PositionRing, StaticShape, StaticState, move_slot
from dspark.models.deepseek_v4.static_step import plan_attention, static_attention
from dspark.sampling import greedy


class MtpLayers:
    """The MTP block seen as a one-layer model: what `StaticState` and `StepTables` build over
    (`layers`, `dtype`, `device`, `kernels`)."""

    def __init__(self, target, depth: int):
        self.layers = [target.mtp[depth]]
        self.dtype, self.device, self.kernels = target.dtype, target.device, target.kernels


class StaticMtpDrafter:
    """Static observe / propose of an `MtpDrafter` over one bucket's state (module docstring).

    shape : `StaticShape` — slots S, max_context C (target positions 0 .. C − 1), tokens T (rows per
        observe at most: the verify width).
    """

    def __init__(self, drafter: MtpDrafter, shape: StaticShape):
        if not isinstance(drafter, MtpDrafter):
            raise ValueError(f"drafter must be an MtpDrafter, got {type(drafter).__name__}")
        if not isinstance(shape, StaticShape):
            raise ValueError(f"shape must be a StaticShape, got {shape!r}")
        if drafter.block_size > shape.tokens + 1:
            # A chain of k links writes MTP positions L − 1 .. L + k − 2, which land on the ring rows of
            # positions Rw = W − 1 + T earlier: older than any later query's window only while k <= T + 1.
            raise ValueError(f"block_size {drafter.block_size} exceeds the verify width tokens={shape.tokens} + 1")
        self.drafter = drafter
        self.shape = shape
        target = drafter.target
        self.target, self.block = target, target.mtp[drafter.depth]
        self.device = target.device
        layers = MtpLayers(target, drafter.depth)
        self.state = StaticState(layers, shape)
        plan = StepPlan()
        plan_attention(self.block.attn, plan, self.state.layers[0])
        self.tables = StepTables(layers, shape, plan)  # made here: never inside a captured call
        width = (target.config.hc_mult, target.config.hidden_size)
        self.streams = PositionRing(torch.zeros(shape.slots, shape.tokens + 1, *width, dtype=target.dtype,
                                                device=self.device))
        # per slot: the noise key of its request (`static_chain.noise_key`), which sampled drafts hash
        self.noise_keys = torch.zeros(shape.slots, dtype=torch.long, device=self.device)
        self._slot_noise = get_op(target_kernels(target) or KernelConfig(), "slot_noise")

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    def load(self, slot: int, dstate: MtpState, key: int = 0) -> int:
        """Copy a request's dynamic MTP state and its noise key (`static_chain.noise_key`) into `slot`;
        returns the position of its next anchor (its MTP length + 1, which is the target's length).
        Host-side, never captured."""
        if not isinstance(dstate, MtpState) or dstate.pending is None:
            raise ValueError("dstate must be an MtpState that observed at least one row (its pending streams)")
        length = self.state.load(slot, dstate.state)  # checks the slot and the capacity
        self.streams.load(slot, length, dstate.pending[None])  # X_{L−1}, L − 1 = the MTP length
        self.noise_keys[slot] = key
        return length + 1

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request: copy src's window and streams rows and its key."""
        move_slot(self.state.slot_tensors() + [self.streams.data], self.shape.slots, src, dst)
        self.noise_keys[dst] = self.noise_keys[src]

    def plan(self, anchors, positions, temperature=None):
        """Validate host values and copy them to the device (`static_drafter.plan_propose`): anchors
        [b], their target positions [b] (>= 1 for a slot that holds a request), temperature [b] or None."""
        return plan_propose(anchors, positions, temperature, self.shape.slots, self.target.config.vocab_size,
                            self.device)

    # ---------------------------------------------------------------------------------------
    # Device side (capturable)
    # ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def observe(self, hidden: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor) -> None:
        """Write the pairs of a verify step's rows of slots 0 .. b − 1 (module docstring).

        hidden [b, t, n_hc, D] the target's final streams of the step, starts long [b] its start
        positions, ids long [b, t] its tokens (device tensors; values trusted: the target's plan checks
        them). t <= T.
        """
        b, t = ids.shape if ids.dim() == 2 else (-1, -1)
        width = (self.target.config.hc_mult, self.target.config.hidden_size)
        if not 1 <= b <= self.shape.slots or not 1 <= t <= self.shape.tokens or tuple(hidden.shape) != (b, t, *width) \
                or tuple(starts.shape) != (b,):
            raise ValueError(f"observe: hidden {tuple(hidden.shape)}, starts {tuple(starts.shape)} and ids "
                             f"{tuple(ids.shape)} must be [b, t, {width[0]}, {width[1]}], [b] and [b, t] with "
                             f"b <= {self.shape.slots}, t <= {self.shape.tokens}")
        ring = self.streams
        before = ring.flat().index_select(0, ring.rows(starts - 1))  # [b, n_hc, D] X_{s−1}, read before the writes
        pairs = torch.cat((before[:, None], hidden[:, :-1].to(ring.data.dtype)), dim=1).flatten(0, 1)  # [b·t, n_hc, D]
        ring.write(starts[:, None] + torch.arange(t, device=starts.device), hidden.flatten(0, 1))
        index = StepIndex((starts - 1).clamp_min(0), t, self.tables)  # MTP positions s − 1 ..
        attn, window = self.block.attn, self.state.layers[0].window
        x = self.block.mix_inputs(self.target.embed(ids.reshape(-1)), pairs)  # [b·t, n_hc, D]
        h = self.block.attn_site(x).h  # [b·t, D] after attn_norm
        cos, sin = index.cos_sin(attn.rope)
        # the window latent of `project_qkv`, stored at its ring row by the norm + RoPE op
        attn.norm_rope_op(attn.wkv(h), attn.kv_norm.weight, cos, sin, eps=attn.kv_norm.eps, out=window.flat(),
                          out_rows=index.ring_rows(window).reshape(-1))

    @torch.no_grad()
    def propose(self, anchors: torch.Tensor, positions: torch.Tensor,
                temperature: torch.Tensor | None = None) -> DraftProposal:
        """Draft k tokens for each of slots 0 .. b − 1: anchors long [b] at target positions long [b]
        (device; values as `plan` checks them); temperature fp32 [b] (0 = greedy row) or None (all
        greedy, `probs` None; sampled rows hash their slot's noise key, `dspark.kernels.slot_noise`).
        Returns a `DraftProposal` (tokens [b, k], probs [b, k, V] or None, confidence [b, k],
        confidence_logits None)."""
        b = anchors.shape[0] if anchors.dim() == 1 else -1
        if not 1 <= b <= self.shape.slots or tuple(positions.shape) != (b,):
            raise ValueError(f"anchors {tuple(anchors.shape)} and positions {tuple(positions.shape)} must be "
                             f"[b<={self.shape.slots}]")
        if temperature is not None:
            greedy_row, t = row_temperatures(temperature)
        streams = self.streams.flat().index_select(0, self.streams.rows(positions - 1))  # [b, n_hc, D] X_{L−1}
        start = (positions - 1).clamp_min(0)  # [b] MTP position of the first link
        prev, tokens, probs = anchors, [], []
        for j in range(self.drafter.block_size):
            logits, streams = self._link(streams, prev, start + j if j else start)
            if temperature is None:
                prev = greedy(logits)
            else:
                noise = self._slot_noise(self.noise_keys[:b], positions + 1 + j, logits.shape[-1])  # token j's position
                prev, q = pick_static(logits, greedy_row, t, noise)
                probs.append(q)
            tokens.append(prev)
        token_block = torch.stack(tokens, dim=1)  # [b, k]
        conf = torch.full(token_block.shape, self.drafter.confidence, dtype=torch.float32, device=self.device)
        return DraftProposal(token_block, torch.stack(probs, dim=1) if probs else None, conf)

    def _link(self, streams: torch.Tensor, prev: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the block (`Block.forward` with the static attention): streams [b, n_hc, D] and
        token ids prev [b] at MTP positions [b] -> (logits fp32 [b, V], output streams [b, n_hc, D])."""
        block, target = self.block, self.target
        index = StepIndex(positions, 1, self.tables)
        x = block.mix_inputs(target.embed(prev), streams.to(target.dtype))
        site = block.attn_site(x)
        a = static_attention(block.attn, site.h, index, self.state.layers[0])
        y, pending = block.ffn_after(a, x, site, prev)
        x = block.close(pending, y)
        return target._logits(block.collapse(x)), x
