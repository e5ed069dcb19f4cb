"""What dspark needs to know about a transformers causal LM, and the shape of its DSpark stages.

`HFTargetConfig` is read once from the wrapped model's (text) config: the facts the engine and the
drafter read from any target (`vocab_size`, `num_hidden_layers`, `hidden_size`,
`max_position_embeddings`, `eos_token_id`), plus the drafter defaults for this target.

A DSpark drafter we train for an HF target uses the same V4-style stages as for a DeepSeek target
(sliding-window attention over injected context keys, a score-routed MoE, mHC; `dspark.draft.stages`),
sized from the target's hidden size by `DraftStageShape` (every size can be overridden). Their
hidden size must equal the target's: the stages read the target's frozen embedding and LM head.

`check_rewindable` refuses models whose per-request state is more than a KV cache that can be cut:
speculative decoding rewinds the target to the accepted prefix after every verify.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dspark.models.deepseek_v4.config import DeepseekV4Config

# Layer kinds whose whole state is one key/value row per token, so cutting rows rewinds them exactly.
CROPPABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {value!r} must be an int >= 1")


@dataclass(frozen=True)
class DraftStageShape:
    """Sizes of one V4-style DSpark stage for an HF target of hidden size D (None = derived from D).

    hc_mult : residual streams of the stage (mHC); num_attention_heads (default D // 64, >= 1),
    head_dim (64), qk_rope_head_dim (head_dim // 2): query heads and the shared K = V latent;
    q_lora_rank, o_lora_rank (D // 2), o_groups (1): low-rank query and grouped output projections;
    moe_intermediate_size (D), n_routed_experts (4), num_experts_per_tok (1): the MoE (plus one
    shared expert); sliding_window (128): committed context rows a block sees.
    """

    hc_mult: int = 4
    num_attention_heads: int | None = None
    head_dim: int = 64
    qk_rope_head_dim: int | None = None
    q_lora_rank: int | None = None
    o_groups: int = 1
    o_lora_rank: int | None = None
    moe_intermediate_size: int | None = None
    n_routed_experts: int = 4
    num_experts_per_tok: int = 1
    sliding_window: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                _positive_int(f"draft_stage.{f.name}", value)
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"draft_stage.num_experts_per_tok: {self.num_experts_per_tok} exceeds "
                             f"n_routed_experts={self.n_routed_experts}")

    def resolved(self, hidden_size: int) -> DraftStageShape:
        """Every None replaced by its default for hidden size `hidden_size`; checked for consistency."""
        heads = self.num_attention_heads or max(1, hidden_size // 64)
        shape = dataclasses.replace(
            self, num_attention_heads=heads, qk_rope_head_dim=self.qk_rope_head_dim or self.head_dim // 2,
            q_lora_rank=self.q_lora_rank or max(1, hidden_size // 2),
            o_lora_rank=self.o_lora_rank or max(1, hidden_size // 2),
            moe_intermediate_size=self.moe_intermediate_size or hidden_size)
        if heads % shape.o_groups:
            raise ValueError(f"draft_stage.o_groups: {shape.o_groups} must divide num_attention_heads={heads}")
        if shape.qk_rope_head_dim % 2 or shape.qk_rope_head_dim > shape.head_dim:
            raise ValueError(f"draft_stage.qk_rope_head_dim: {shape.qk_rope_head_dim} must be even and "
                             f"<= head_dim={shape.head_dim}")
        return shape


def _spread_layers(n_layers: int, count: int) -> tuple[int, ...]:
    """`count` feature layer ids spread from 1 to n_layers − 1 (DeepSpec's offline choice: ~5 layers from
    the second to the third-last output); fewer when the target is too shallow."""
    lo, hi = min(1, n_layers), max(min(1, n_layers), n_layers - 1)
    if hi - lo + 1 <= count:
        return tuple(range(lo, hi + 1))
    return tuple(sorted({lo + round(k * (hi - lo) / (count - 1)) for k in range(count)}))


@dataclass(frozen=True)
class HFTargetConfig:
    """Facts of a wrapped transformers causal LM (its text config) and its DSpark stage shape.

    model_type : transformers' model_type (e.g. "llama", "gemma3_text");
    vocab_size, hidden_size, num_hidden_layers, max_position_embeddings, rms_norm_eps, rope_theta;
    eos_token_id : the ids that end generation (config and generation_config merged);
    pad_token_id : the default noise token of a DSpark drafter (else the last id);
    stage : the resolved `DraftStageShape` of DSpark stages built for this target;
    kv_values_per_token : K and V values one token adds to the cache over all layers (every layer
    keeps every row: sliding layers are limited by the mask), for the engine's state budget.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]
    pad_token_id: int | None
    rms_norm_eps: float
    rope_theta: float
    stage: DraftStageShape
    kv_values_per_token: int = 0

    # The drafter defaults that `DSparkConfig` reads from any target config.
    @property
    def n_routed_experts(self) -> int:
        return self.stage.n_routed_experts

    @property
    def num_experts_per_tok(self) -> int:
        return self.stage.num_experts_per_tok

    @property
    def sliding_window(self) -> int:
        return self.stage.sliding_window

    def dspark_defaults(self) -> dict:
        """`DSparkConfig` defaults for this target: the paper's offline setting (γ = 7, five stages,
        one per feature layer spread over the target, Markov rank 256), noise = pad id or last id."""
        noise = self.pad_token_id if self.pad_token_id is not None else self.vocab_size - 1
        return dict(dspark_block_size=7, dspark_target_layer_ids=_spread_layers(self.num_hidden_layers, 5),
                    dspark_noise_token_id=noise, dspark_markov_rank=256)

    def draft_stage_config(self) -> DeepseekV4Config:
        """A one-layer sliding-window V4 config with the stage shape: what each DSpark stage is built from."""
        s = self.stage
        return DeepseekV4Config.from_dict(dict(
            model_type="deepseek_v4", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"],
            num_attention_heads=s.num_attention_heads, head_dim=s.head_dim, qk_rope_head_dim=s.qk_rope_head_dim,
            q_lora_rank=s.q_lora_rank, o_groups=s.o_groups, o_lora_rank=s.o_lora_rank,
            moe_intermediate_size=s.moe_intermediate_size, n_routed_experts=s.n_routed_experts,
            num_experts_per_tok=s.num_experts_per_tok, sliding_window=s.sliding_window, hc_mult=s.hc_mult,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, num_nextn_predict_layers=0, index_n_heads=1, index_head_dim=8,
            index_topk=1))

    @classmethod
    def from_hf(cls, hf_config, generation_config=None, stage: DraftStageShape | None = None) -> HFTargetConfig:
        """Read a transformers config (its decoder text config for multimodal wrappers)."""
        c = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
        eos = set(_ids(getattr(hf_config, "eos_token_id", None)) + _ids(getattr(c, "eos_token_id", None)))
        eos |= set(_ids(getattr(generation_config, "eos_token_id", None)))
        hidden = int(c.hidden_size)
        heads = int(getattr(c, "num_attention_heads", None) or 1)
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        rope = getattr(c, "rope_parameters", None) or {}
        theta = getattr(c, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None)
        return cls(model_type=str(c.model_type), vocab_size=int(c.vocab_size), hidden_size=hidden,
                   num_hidden_layers=int(c.num_hidden_layers),
                   max_position_embeddings=int(getattr(c, "max_position_embeddings", None) or 4096),
                   eos_token_id=tuple(sorted(eos)), pad_token_id=getattr(c, "pad_token_id", None),
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or 1e-6),
                   rope_theta=float(theta or 10000.0),
                   stage=(stage or DraftStageShape()).resolved(hidden),
                   kv_values_per_token=int(c.num_hidden_layers) * 2 * kv_heads * head_dim)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def check_rewindable(hf_model) -> None:
    """Raise ValueError naming why `hf_model`'s decode state cannot be cut back to a prefix."""
    name = type(hf_model).__name__
    config = hf_model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name}: encoder-decoder models are not causal LMs; dspark drives decoder-only targets")
    if getattr(hf_model, "_is_stateful", False):
        raise ValueError(f"{name}: transformers marks this model stateful (recurrent, convolutional or compressed "
                         "state besides the KV cache); that state cannot be rewound to the accepted prefix by "
                         "cropping the cache, so speculative decoding cannot verify drafts exactly")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = sorted(set(getattr(text, "layer_types", None) or ()) - set(CROPPABLE_LAYER_TYPES))
    if kinds:
        raise ValueError(f"{name}: layer type(s) {kinds} keep state that a KV-cache crop cannot rewind "
                         f"(croppable: {', '.join(CROPPABLE_LAYER_TYPES)})")
    decoder = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) != text.num_hidden_layers or not hasattr(decoder, "norm"):
        raise ValueError(f"{name}: expected a decoder with `layers` ({text.num_hidden_layers}) and a final `norm` "
                         "(the drafter's context features are the inputs of chosen layers)")
    if hf_model.get_output_embeddings() is None:
        raise ValueError(f"{name}: has no LM head (get_output_embeddings() is None); load it as a causal LM")
