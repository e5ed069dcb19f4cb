"""`DSparkDrafter`: DSpark behind the `Drafter` interface of `dspark.generate` (docs/design.md).

One round for a batch of requests (dspark spec §2.2):

    observe   committed target rows -> main_x -> per-stage context keys of the last W rows (state)
    propose   block [anchor, noise × (γ−1)] at positions L .. L+γ−1 (L = committed length)
              -> stages over all requests' blocks at once (each sees its own window + own block)
              -> base logits -> Markov chain sampled left to right -> confidences

Past the stages every step is per slot and runs left to right, so a caller that verifies only the
first n ≤ γ drafts (a fixed budget) asks `propose` for `n_draft=n`: the LM head, the chain and the
confidence head then run n slots, and those n drafts are the first n of the full block's (the same
rows, fewer of them; on a GPU the head's low-precision GEMM over fewer rows may round differently).

The drafter holds the target only to borrow its frozen embedding and LM head (spec §1.5); the
trainable network is `self.model` (a `DSparkModel`, keys `mtp.*`). Confidence logits z_k become
c_k = σ(z_k / T_k + b_k) with the STS calibration of the request's kind, greedy or sampled
(`calibration_for`; identity when None).

Shape symbols: B requests, γ block size, V vocabulary, D hidden size, n committed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.draft.base import DraftProposal
from dspark.draft.config import DSparkConfig
from dspark.draft.context import DSparkState, gather_context
from dspark.draft.dspark_v4 import BlockOutput, DSparkModel, check_n_draft, target_kernels
from dspark.draft.markov_head import sample_chain
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from dspark.verify.sts import StsCalibration


@dataclass
class BlockDraft:
    """What the backbone produced for one `propose` call: `out` (BlockOutput over B blocks, its first
    k slots each) and the absolute positions [B, γ] of the block slots (slot k of an anchor at L sits
    at L + k)."""

    out: BlockOutput
    positions: torch.Tensor


class DSparkDrafter:
    """DSpark drafter for a DeepSeek-V4 target.

    Parameters
    ----------
    target : the target model (`DeepseekV4ForCausalLM`); its `embed` and `head` are used, frozen.
    config : DSparkConfig; default `DSparkConfig.for_target(target.config)`.
    model : an existing `DSparkModel` to wrap (loaded or being trained); default a new one, in the
        target's dtype and device, with torch's default initialisation (call `init_weights` or load
        weights before drafting).
    calibration : StsCalibration with γ temperatures, or None for c_k = σ(z_k): for sampled requests,
        and for greedy ones unless `greedy_calibration` is given.
    greedy_calibration : StsCalibration fitted on greedy rounds, for greedy requests (acceptance under
        greedy verification differs from sampled acceptance, `dspark.verify.sts`), or None.

    `capacity_tables` maps a device type ("cpu", "cuda"), or a device type and card ("cuda-h100"), each
    with "-sampled" for sampled rounds, to the capacity table shipped with the drafter for it
    (`dspark.draft.io`), the engine's default planner table there (`engine.default_capacity`); empty
    unless loaded.
    """

    def __init__(self, target, config: DSparkConfig | None = None, model: DSparkModel | None = None,
                 calibration: StsCalibration | None = None, greedy_calibration: StsCalibration | None = None):
        if config is None:
            config = model.config if model is not None else DSparkConfig.for_target(target.config)
        if model is None:
            model = DSparkModel(config, target.config, dtype=target.dtype, device=target.device,
                                kernels=target_kernels(target)).eval()
        elif model.config != config:
            raise ValueError("model: its DSparkConfig differs from the config passed to DSparkDrafter")
        self.target = target
        self.config = config
        self.model = model
        self.block_size = config.dspark_block_size
        self.capture_layers = tuple(config.dspark_target_layer_ids)
        self.window = model.window
        self.calibration = self.greedy_calibration = None
        self.capacity_tables: dict[str, CapacityTable] = {}
        self.set_calibration(calibration)
        self.set_calibration(greedy_calibration, greedy=True)

    def set_calibration(self, calibration: StsCalibration | None, greedy: bool = False) -> None:
        """Set the calibration of sampled requests (`greedy` False; also greedy ones', unless a greedy
        calibration is set) or of greedy requests (`greedy` True)."""
        if calibration is not None and calibration.gamma != self.block_size:
            raise ValueError(f"calibration: fitted for γ={calibration.gamma}, drafter has γ={self.block_size}")
        if greedy:
            self.greedy_calibration = calibration
        else:
            self.calibration = calibration

    def calibration_for(self, greedy: bool) -> StsCalibration | None:
        """The calibration of greedy (True) or sampled (False) requests; None: c_k = σ(z_k)."""
        return self.greedy_calibration or self.calibration if greedy else self.calibration

    def init_weights(self, seed: int = 0) -> DSparkDrafter:
        self.model.init_weights(seed)
        return self

    # ---------------------------------------------------------------------------------------
    # Drafter protocol
    # ---------------------------------------------------------------------------------------

    def new_state(self) -> DSparkState:
        return DSparkState(self.config.num_stages, self.window)

    @torch.no_grad()
    def observe(self, dstate: DSparkState, token_ids: torch.Tensor, hidden: torch.Tensor,
                features: dict[int, torch.Tensor]) -> None:
        """Append n committed rows: token_ids [n] (unused: the context is the target's features),
        hidden [n, n_hc, D] (unused), features {layer id: [n, n_hc, D]}. Only the last W rows are
        kept, so only their keys are computed."""
        n = int(token_ids.shape[0])
        if n == 0:
            return
        missing = [i for i in self.capture_layers if i not in features]
        if missing:
            raise ValueError(f"observe: features lack target layer(s) {missing} (capture_layers)")
        keep = min(n, self.window)
        rows = slice(n - keep, n)
        device = self.model.device
        positions = torch.arange(dstate.length + n - keep, dstate.length + n, device=device)
        main_x = self.model.main_x({i: features[i][rows].to(device) for i in self.capture_layers})
        dstate.append(self.model.context_latents(main_x, positions), n)

    @torch.no_grad()
    def propose(self, dstates: list[DSparkState], anchors: list[int], params: SamplingParams,
                generators: list[torch.Generator], n_draft: int | None = None) -> DraftProposal:
        """Draft the first k = `n_draft` (an int in [1, γ]; default γ) tokens of each request's block:
        tokens [B, k], probs [B, k, V] (sampled) and confidences [B, k]. Leaves every state unchanged
        (block keys are transient)."""
        if len(dstates) != len(anchors) or len(generators) != len(anchors):
            raise ValueError(f"propose: {len(dstates)} states, {len(anchors)} anchors and {len(generators)} "
                             "generators must match")
        draft = self.block_logits(dstates, anchors, check_n_draft(n_draft, self.block_size))
        out = draft.out
        anchor_ids = torch.tensor(anchors, dtype=torch.long, device=out.base.device)
        tokens, probs, prev_embeds = sample_chain(self.model.markov_head, out.base, out.hidden, anchor_ids,
                                                  params, generators)
        z = self.model.confidence_head(out.hidden_pre, prev_embeds)  # [B, k] raw logits
        calibration = self.calibration_for(params.greedy)
        conf = calibration.apply_first(z) if calibration is not None else torch.sigmoid(z)
        return DraftProposal(tokens, probs, conf, confidence_logits=z)

    def block_logits(self, dstates: list[DSparkState], anchors: list[int], n_draft: int | None = None) -> BlockDraft:
        """Backbone over every request's block: [anchor, noise × (γ−1)] at positions L_b .. L_b+γ−1,
        past it the first k = `n_draft` slots (default γ)."""
        device = self.model.device
        starts = torch.tensor([s.length for s in dstates], device=device)
        pools, index = gather_context(dstates, self.window, self.model.head_dim, self.model.dtype, device)
        return self.block_from(torch.tensor(anchors, dtype=torch.long, device=device), starts, pools, index,
                               n_draft)

    def block_from(self, anchor_ids: torch.Tensor, starts: torch.Tensor, pools: list[torch.Tensor],
                   index: torch.Tensor, n_draft: int | None = None) -> BlockDraft:
        """The backbone on device inputs; shared by `block_logits` and the static drafter
        (`static_drafter.py`), so it reads no value on the host.

        anchor_ids LongTensor [B]; starts LongTensor [B] the anchors' positions L_b; pools per stage
        [P, d] context keys; index LongTensor [B, W] the pool rows of positions L_b − W .. L_b − 1
        (−1 = absent). All on the drafter's device. n_draft k in [1, γ] (default γ): the slots of
        each block taken past the backbone (`DSparkModel.blocks`).
        """
        gamma, device = self.block_size, self.model.device
        positions = starts[:, None] + torch.arange(gamma, device=device)  # [B, γ]
        ids = torch.full((anchor_ids.shape[0], gamma), self.config.dspark_noise_token_id, dtype=torch.long,
                         device=device)
        ids[:, 0] = anchor_ids
        ids = ids.flatten()
        embeds = self.target.embed(ids.to(self.target.device)).to(device)  # [B·γ, D], frozen target embedding
        out = self.model.blocks(embeds, ids, positions.flatten(), pools, index.repeat_interleave(gamma, dim=0),
                                self.target.head.weight, n_draft)
        return BlockDraft(out, positions)
