"""`HFCausalLM`: any transformers decoder-only causal LM behind dspark's target contract (docs/design.md).

    out = target(input_ids [N], states, seq_lens, capture_layers=(...))

The N rows are the concatenated new tokens of several requests (prompt chunks, one decode token, or
a verify block [anchor, x_0..x_{ℓ-1}]). Each request runs as one transformers forward over its own
`DynamicCache` (`HFDecodeState`), positions continuing at `state.length`; the rows come back in the
order of `states`. Requests are therefore processed one after another, never padded together: a
request's logits do not depend on which others share the step.

Context features for a drafter are the *inputs* of the requested decoder layers (id ℓ < L: the
residual stream entering layer ℓ; id L: the stream entering the final norm), caught with forward
pre-hooks that live for one call only. They and `hidden` (the stream entering the final norm) have
one stream: [N, 1, D], like the DeepSeek targets' [N, n_hc, D] with n_hc = 1.

`embed` and `head` are the model's own input embedding (with any scaling it applies, e.g. Gemma's
√D) and LM head, shared frozen with the drafter. Shape symbols: N rows, V vocabulary, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dspark.models.deepseek_v4.state import check_capture
from dspark.models.hf_causal.config import DraftStageShape, HFTargetConfig, check_rewindable
from dspark.models.hf_causal.state import HFDecodeState


@dataclass
class HFCausalOutput:
    """logits fp32 [N, V]; hidden [N, 1, D] stream entering the final norm; features {ℓ: [N, 1, D]}."""

    logits: torch.Tensor
    hidden: torch.Tensor
    features: dict[int, torch.Tensor] = field(default_factory=dict)


class _LayerInputs:
    """Forward pre-hooks that record the hidden-state input of chosen modules during one call."""

    def __init__(self, modules: dict[int, nn.Module]):
        self.seen: dict[int, torch.Tensor] = {}
        self._handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, m in modules.items()]

    def _hook(self, layer_id: int):
        def record(module, args, kwargs):
            self.seen[layer_id] = args[0] if args else kwargs["hidden_states"]
        return record

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class HFCausalLM(nn.Module):
    """A transformers causal LM as a dspark target.

    Parameters
    ----------
    hf_model : a decoder-only `PreTrainedModel` with an LM head (e.g. `AutoModelForCausalLM`), in
        eval mode; used where it lives (device, dtype). ValueError when its state cannot be rewound
        (`check_rewindable`).
    tokenizer : its tokenizer, or None (then prompts are token ids).
    draft_stage : the `DraftStageShape` of DSpark stages built for this target (default sizes).
    """

    # Text prompts are encoded as `tokenizer(text)` encodes them, special tokens included: a
    # transformers model was trained on its tokenizer's framing (Gemma degenerates without its BOS).
    prompt_special_tokens = True

    def __init__(self, hf_model, tokenizer=None, draft_stage: DraftStageShape | None = None):
        super().__init__()
        check_rewindable(hf_model)
        self.hf = hf_model.eval()
        self.tokenizer = tokenizer
        self.config = HFTargetConfig.from_hf(hf_model.config, getattr(hf_model, "generation_config", None),
                                             draft_stage)
        self.dspark = None  # a trained drafter shipped beside the weights (`load_model`), else None
        self.has_mtp = False
        decoder = hf_model.get_decoder()
        self._layers = decoder.layers
        self._final_norm = decoder.norm

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def embed(self) -> nn.Module:
        """The input embedding module: ids [n] -> [n, D] (as the model embeds them, scaling included)."""
        return self.hf.get_input_embeddings()

    @property
    def head(self) -> nn.Module:
        """The LM head; `head.weight` [V, D] (the tied embedding for tied models)."""
        return self.hf.get_output_embeddings()

    def new_state(self) -> HFDecodeState:
        return HFDecodeState()

    def forward(self, input_ids: torch.Tensor, states: list[HFDecodeState], seq_lens: list[int],
                capture_layers: tuple[int, ...] = ()) -> HFCausalOutput:
        """Feed request b's `seq_lens[b]` new tokens and append them to `states[b]`.

        input_ids LongTensor [N]; states one `HFDecodeState` per request; seq_lens >= 1 each, sum N;
        capture_layers ids in [0, L] whose input streams to return in `features`.
        """
        capture = check_capture(capture_layers, len(self._layers))
        seq_lens = self._check(input_ids, states, seq_lens)
        watched = {i: self._layers[i] for i in capture if i < len(self._layers)}
        watched[len(self._layers)] = self._final_norm  # `hidden`, and feature id L
        hooks = _LayerInputs(watched)
        logits, seen = [], {i: [] for i in watched}
        try:
            for state, ids in zip(states, input_ids.to(self.device).split(seq_lens)):
                logits.append(self._forward_one(ids, state))
                for i in watched:
                    seen[i].append(hooks.seen[i][0])  # [n, D]
        finally:
            hooks.close()
        rows = {i: torch.cat(parts).unsqueeze(-2) for i, parts in seen.items()}  # [N, 1, D]
        return HFCausalOutput(torch.cat(logits), rows[len(self._layers)], {i: rows[i] for i in capture})

    def _forward_one(self, ids: torch.Tensor, state: HFDecodeState) -> torch.Tensor:
        """One request's new tokens ids [n] -> logits fp32 [n, V]; writes them to its cache."""
        positions = torch.arange(state.length, state.length + ids.shape[0], device=ids.device)
        out = self.hf(input_ids=ids[None], position_ids=positions[None], past_key_values=state.cache,
                      use_cache=True)
        state.append(ids.tolist())
        return out.logits[0].float()

    def _check(self, input_ids, states, seq_lens) -> list[int]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a 1-D LongTensor, got {getattr(input_ids, 'shape', input_ids)!r}")
        seq_lens = [int(n) for n in seq_lens]
        if len(seq_lens) != len(states) or not states:
            raise ValueError(f"seq_lens has {len(seq_lens)} entries for {len(states)} states")
        if any(n < 1 for n in seq_lens) or sum(seq_lens) != input_ids.shape[0]:
            raise ValueError(f"seq_lens={seq_lens} must be >= 1 each and sum to len(input_ids)={input_ids.shape[0]}")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("the same decode state appears twice in one call")
        wrong = [b for b, s in enumerate(states) if not isinstance(s, HFDecodeState)]
        if wrong:
            raise ValueError(f"states {wrong} do not belong to this model (expected HFDecodeState from new_state())")
        return seq_lens
