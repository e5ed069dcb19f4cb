"""A static-shape, CUDA-graph-capturable DSpark `observe` / `propose` over S slots.

    static = StaticDrafter(drafter, StaticDraftShape(slots=8, tokens=drafter.block_size + 1), n_draft=3)
    next_anchor = static.load(slot, dstate, key)             # a request's state after its (dynamic) prefill
    static.observe(features, starts)                         # committed rows [S, T] at starts [S]
    anchors, positions, temps = static.plan(anchors_host, positions_host, temps_host)   # host: validate, copy
    proposal = static.propose(anchors, positions, temps)                                # no host read

`observe` computes the context keys of every row it is given (main_x, then each stage's keys) and
writes them into the rings of `static_context.py`; `propose` runs the backbone over all S blocks
(`DSparkDrafter.block_from`, the dynamic path's own code), the device-side chain of
`static_chain.py` and the confidence head. Shapes and launches never depend on data, so `propose`
(and `observe`) can be captured once per bucket and replayed (`static_graph.py`). `n_draft` k ≤ γ
fixes how many leading slots of each block `propose` drafts (default γ): the backbone runs all γ
(attention inside a block is bidirectional), the LM head, chain and confidence head only k, so a
caller that verifies at most k drafts per round does not pay for the rest. Every call may run
on the first b <= S slots only (inputs [b]; features [b, T, ...]): it reads and writes those slots'
rows and leaves the rest as they are (the engine keeps its live slots at 0 .. n − 1).

Rollback: after a verify round a slot's committed rows are its anchor plus the accepted drafts;
`observe` may be fed all γ + 1 rows of the round at the anchor's position, and the next anchor
position (start + accepted + 1) hides the rest. Unused slots: give them anchor position 0 (or any
position; they read only their own rows) and any anchor id; they change no other slot's result.

Host syncs: none in `observe` / `propose` when the target's `KernelConfig` is the Triton one. On the
CPU the stages' reference MoE reads expert counts on the host; fine there, where the static path is
tested against the dynamic one, but not capturable.

Shape symbols: S slots, T rows per observe, γ block size, k ≤ γ slots drafted, V vocabulary, n_hc
streams, D hidden size.
"""

from __future__ import annotations

import math

import torch

from dspark.draft.base import DraftProposal
from dspark.draft.context import DSparkState
from dspark.draft.drafter import DSparkDrafter
from dspark.draft.dspark_v4 import check_n_draft
from dspark.draft.static_chain import sample_chain_static
from dspark.draft.static_context import StaticDraftShape, StaticDraftState
from dspark.sampling import MIN_TEMPERATURE


class StaticDrafter:
    """Static observe / propose of a `DSparkDrafter` over one bucket's state (`StaticDraftState`),
    drafting the first `n_draft` k slots of each block (an int in [1, γ]; default γ)."""

    def __init__(self, drafter: DSparkDrafter, shape: StaticDraftShape, n_draft: int | None = None):
        if not isinstance(drafter, DSparkDrafter):
            raise ValueError(f"drafter must be a DSparkDrafter, got {type(drafter).__name__}")
        self.drafter = drafter
        self.shape = shape
        self.n_draft = check_n_draft(n_draft, drafter.block_size)
        model = drafter.model
        self.device = model.device
        self.state = StaticDraftState(drafter.config.num_stages, drafter.window, model.head_dim, shape, model.dtype,
                                      self.device)
        # per slot: the noise key of its request (`static_chain.noise_key`), which sampled drafts hash
        self.noise_keys = torch.zeros(shape.slots, dtype=torch.long, device=self.device)
        self._calibrations, self._conf_params = None, None

    def load(self, slot: int, dstate: DSparkState, key: int = 0) -> int:
        """Copy a request's dynamic draft state and its noise key (`static_chain.noise_key`; greedy
        requests never read it) into `slot`; returns the position of its next anchor."""
        length = self.state.load(slot, dstate)
        self.noise_keys[slot] = key
        return length

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request: its rows and its noise key."""
        self.state.move(src, dst)
        self.noise_keys[dst] = self.noise_keys[src]

    # ---------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------

    def plan(self, anchors, positions, temperature=None):
        """Validate host values and copy them to the drafter's device (`plan_propose`)."""
        vocab = self.drafter.model.markov_head.embed.num_embeddings
        return plan_propose(anchors, positions, temperature, self.shape.slots, vocab, self.device)

    # ---------------------------------------------------------------------------------------
    # Device side (capturable)
    # ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def observe(self, features: dict[int, torch.Tensor], starts: torch.Tensor) -> None:
        """Write the context keys of rows at positions starts[s] + 0 .. T − 1 of every slot.

        features {target layer id: [b, T, n_hc, D]} (slots 0 .. b − 1, b <= S; T <= shape.tokens; the
        target's captured layer inputs of those rows); starts long [b] on the device (values trusted:
        the target's plan checks them). Rows past a slot's next anchor position are invisible (module
        docstring).
        """
        t_max = self.shape.tokens
        missing = [i for i in self.drafter.capture_layers if i not in features]
        if missing:
            raise ValueError(f"observe: features lack target layer(s) {missing} (capture_layers)")
        first = features[self.drafter.capture_layers[0]]
        s, n_tok = first.shape[:2] if first.dim() == 4 else (-1, -1)
        for i in self.drafter.capture_layers:
            f = features[i]
            if f.dim() != 4 or f.shape[0] != s or not 1 <= s <= self.shape.slots or f.shape[1] != n_tok \
                    or not 1 <= n_tok <= t_max:
                raise ValueError(f"features[{i}] must be [b<={self.shape.slots}, T<={t_max}, n_hc, D] like "
                                 f"every layer's, got {tuple(f.shape)}")
        self._check_index("starts", starts, s)
        positions = starts[:, None] + torch.arange(n_tok, device=starts.device)  # [S, T]
        model = self.drafter.model
        main_x = model.main_x({i: features[i].flatten(0, 1).to(self.device) for i in self.drafter.capture_layers})
        self.state.write(positions, model.context_latents(main_x, positions.reshape(-1)))

    @torch.no_grad()
    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor | None = None,
                width: int | None = None) -> DraftProposal:
        """Draft k tokens for each of slots 0 .. b − 1 (k = `width`, an int in [1, n_draft], default
        `n_draft`): anchors long [b] at positions long [b] (device; values as `plan` checks them);
        temperature fp32 [b] or None (all greedy, `probs` None; sampled rows hash their slot's noise
        key, `dspark.kernels.slot_noise`). Returns a `DraftProposal` (tokens [b, k], probs [b, k, V] or
        None, confidence and confidence_logits [b, k]). Reads the state only."""
        k = self.n_draft if width is None else width
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n_draft:
            raise ValueError(f"width must be None or an int in [1, n_draft={self.n_draft}], got {width!r}")
        b = anchors.shape[0] if isinstance(anchors, torch.Tensor) and anchors.dim() == 1 else -1
        self._check_index("anchors", anchors, b)
        self._check_index("positions", positions, b)
        if temperature is not None and (tuple(temperature.shape) != (b,) or temperature.device != self.device):
            raise ValueError(f"temperature must be [b={b}] on {self.device}, got "
                             f"{tuple(temperature.shape)} on {temperature.device}")
        drafter = self.drafter
        out = drafter.block_from(anchors, positions, self.state.pools(), self.state.context_index(positions), k).out
        tokens, probs, prev_embeds = sample_chain_static(drafter.model.markov_head, out.base, out.hidden, anchors,
                                                         temperature, self.noise_keys[:b], positions)
        z = drafter.model.confidence_head(out.hidden_pre, prev_embeds)  # [b, k] raw logits
        return DraftProposal(tokens, probs, self._confidence(z, temperature), confidence_logits=z)

    def _confidence(self, z: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
        """c = σ(z / T + b) [b, k] of raw logits z [b, k], each row with its kind's calibration (greedy
        rows: temperature 0 or None, `DSparkDrafter.calibration_for`), chosen on the device; the same
        ops as `StsCalibration.apply_first`, so the same bits as the dynamic drafter's."""
        params = self._calibration_params()
        if params is None:
            return torch.sigmoid(z)
        k = z.shape[1]
        temps, bias = params[:, 0, :k], params[:, 1, :k]  # [2, k] each: row 0 sampled, row 1 greedy
        if temperature is None:
            return torch.sigmoid(z / temps[1] + bias[1])
        greedy_row = (temperature == 0)[:, None]  # [b, 1]
        return torch.sigmoid(z / torch.where(greedy_row, temps[1], temps[0]) + torch.where(greedy_row, bias[1], bias[0]))

    def _calibration_params(self) -> torch.Tensor | None:
        """fp32 [2 (sampled, greedy), 2 (T, b), n_draft] of the drafter's calibrations on the device,
        None when it has neither; built once per pair of calibration objects (a host-to-device copy
        cannot run inside a capture: set the calibrations before capturing)."""
        pair = (self.drafter.calibration_for(False), self.drafter.calibration_for(True))
        if self._calibrations is None or any(a is not b for a, b in zip(pair, self._calibrations)):
            self._calibrations = pair
            k = self.n_draft
            rows = [[[1.0] * k, [0.0] * k] if c is None else
                    [list(c.temperatures[:k]), list(c.offsets[:k])] for c in pair]
            self._conf_params = None if pair == (None, None) else torch.tensor(rows, dtype=torch.float32,
                                                                                device=self.device)
        return self._conf_params

    def _check_index(self, name: str, t: torch.Tensor, slots: int) -> None:
        """t must be a long [b] tensor on the device, b = `slots` in [1, S]."""
        if not isinstance(t, torch.Tensor) or not 1 <= slots <= self.shape.slots or tuple(t.shape) != (slots,) \
                or t.dtype != torch.long or t.device != self.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name} must be a long [b<={self.shape.slots}] tensor on {self.device} like the "
                             f"call's other inputs, got {got}")


def plan_propose(anchors, positions, temperature, slots: int, vocab: int, device):
    """The host side of a static `propose` over a bucket: validate and copy to `device`.

    anchors [b] token ids in [0, vocab) of slots 0 .. b − 1 (b <= `slots`); positions [b] >= 0 the
    anchors' positions; temperature [b] (0 = greedy, else >= MIN_TEMPERATURE, finite) or None (all
    greedy). Lists or CPU tensors. Returns (anchors long [b], positions long [b], temperature fp32 [b]
    or None) on the device.
    """
    anchors = torch.as_tensor(anchors, dtype=torch.long)
    positions = torch.as_tensor(positions, dtype=torch.long)
    s = anchors.shape[0] if anchors.dim() == 1 else -1
    if not 1 <= s <= slots:
        raise ValueError(f"anchors must be [b<={slots}], got {tuple(anchors.shape)}")
    if tuple(positions.shape) != (s,):
        raise ValueError(f"positions must be [b={s}] like anchors, got {tuple(positions.shape)}")
    bad = ((anchors < 0) | (anchors >= vocab)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"anchors[{int(bad[0])}]={int(anchors[bad[0]])} outside [0, {vocab})")
    bad = (positions < 0).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"positions[{int(bad[0])}]={int(positions[bad[0]])} must be >= 0")
    if temperature is not None:
        temperature = torch.as_tensor(temperature, dtype=torch.float32)
        if tuple(temperature.shape) != (s,):
            raise ValueError(f"temperature must be [b={s}], got {tuple(temperature.shape)}")
        for b, t in enumerate(temperature.tolist()):
            if not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
                raise ValueError(f"temperature[{b}]={t!r}: must be 0 (greedy) or a finite value "
                                 f">= {MIN_TEMPERATURE}")
        temperature = temperature.to(device, non_blocking=True)
    return anchors.to(device, non_blocking=True), positions.to(device, non_blocking=True), temperature
