"""`DeepseekV4Config`: the DeepSeek-V4 `config.json`, read once, validated once, frozen.

Field names are the HF `transformers` / checkpoint names (deepseek_v4 spec §2.1). The released
`config.json` of V4-Flash / V4-Pro carries *legacy* keys, which :meth:`DeepseekV4Config.from_dict`
folds into the modern fields exactly as HF 5.23 does (spec §2.1):

* `compress_ratios` (per-layer 0 / 4 / 128, one trailing entry for the MTP block) -> `layer_types`
* `compress_rate_csa`, `compress_rate_hca`                                         -> `compress_rates`
* `num_hash_layers`                                                                 -> `mlp_layer_types`
* `qk_rope_head_dim`                                                                -> `partial_rotary_factor`
* `rope_scaling` (YaRN)                                       -> `rope_parameters["compress"]` only
* top-level `expert_dtype`                                    -> `quantization_config["expert_dtype"]`

RoPE is resolved into two parameter sets (spec §2.3): "main" (plain RoPE, `rope_theta`, used by
sliding-window-only layers and the MTP block) and "compress" (`compress_rope_theta` with YaRN and
`attention_factor = 1`, i.e. no mscale, used by CSA and HCA layers).

The building blocks of the model read only what they need from this object, so a V4.1 config can
reuse them by providing the same field names (V4.1 adds fields; it does not rename these).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)

HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
ROPE_TYPES = ("default", "yarn")

DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_NULLABLE = frozenset({"pad_token_id", "bos_token_id", "eos_token_id", "quantization_config"})
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512

# Keys that fix tensor shapes or the layer schedule. Defaulting them silently would build a model
# that cannot hold the checkpoint (or, for the schedule, a different one: HF's default schedule
# differs from V4-Pro's by one layer, spec §2.1), so `from_dict` insists on them.
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
)


@dataclass(frozen=True)
class RopeParameters:
    """One resolved RoPE parameter set (spec §7.3). `rope_type` is "default" or "yarn"."""

    rope_type: str
    rope_theta: float
    partial_rotary_factor: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = {"rope_type": self.rope_type, "rope_theta": self.rope_theta,
             "partial_rotary_factor": self.partial_rotary_factor}
        if self.rope_type == "yarn":
            d.update(
                factor=self.factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                attention_factor=self.attention_factor,
                truncate=self.truncate,
            )
        return d


@dataclass(frozen=True)
class DeepseekV4Config:
    """DeepSeek-V4 hyper-parameters (spec §2). Build with :meth:`from_dict` / :meth:`from_json`.

    Defaults are the published V4-Flash values (spec §2.2) for every key outside `REQUIRED_KEYS`.
    `layer_types`, `mlp_layer_types` are tuples; `compress_rates` and `rope_parameters` are dicts
    that must be treated as read-only.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    rope_parameters: dict[str, Any] | None = None
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    quantization_config: dict[str, Any] | None = None
    model_type: str = "deepseek_v4"

    def __post_init__(self):
        # Normalise containers (a caller may pass lists) before validating; frozen => object.__setattr__.
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        object.__setattr__(self, "compress_rates", dict(self.compress_rates))
        rope = self.rope_parameters
        if rope is None or not all(isinstance(v, RopeParameters) for v in rope.values()):
            # None, a flat YaRN dict or HF's nested {"main": {...}, "compress": {...}} form.
            object.__setattr__(self, "rope_parameters", resolve_rope(rope, self))
        _validate(self)

    # ---------------------------------------------------------------------------------------
    # Derived values
    # ---------------------------------------------------------------------------------------

    @property
    def qk_rope_head_dim(self) -> int:
        """Rotary dims at the end of every head (64 for Flash/Pro)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def intermediate_size(self) -> int:
        """Width of the shared expert (HF alias of `moe_intermediate_size`)."""
        return self.moe_intermediate_size

    def compress_rate(self, layer_type: str) -> int:
        """Compression rate `m` of a CSA / HCA layer type (0 for sliding-window-only layers)."""
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    def rope_for(self, layer_type: str) -> RopeParameters:
        """The RoPE parameter set used by layers of `layer_type` (spec §7.3)."""
        return self.rope_parameters["main" if layer_type == SLIDING else "compress"]

    # ---------------------------------------------------------------------------------------
    # Construction from / to config.json
    # ---------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        """Build from a `config.json` dict (HF or official spelling, legacy keys accepted).

        Unknown keys (e.g. `architectures`, `torch_dtype`, DSpark draft knobs) are ignored.
        Raises ValueError naming a missing required key or any invalid value.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a dict, got {type(d).__name__}")
        model_type = d.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ValueError(f"model_type: expected 'deepseek_v4', got {model_type!r}")
        missing = [k for k in REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ValueError(f"config: missing required key(s) {missing}")

        names = {f.name for f in dataclasses.fields(cls)}
        # null means "absent" except where None is itself a value (no pad token, no quantisation).
        kwargs = {k: v for k, v in d.items() if k in names and (v is not None or k in _NULLABLE)}
        n = int(d["num_hidden_layers"])
        kwargs["compress_rates"] = _compress_rates(d)
        kwargs["layer_types"] = _layer_types(d, n, kwargs["compress_rates"])
        kwargs["mlp_layer_types"] = _mlp_layer_types(d, n)
        kwargs["partial_rotary_factor"] = _partial_rotary_factor(d)
        kwargs["quantization_config"] = _quantization_config(d)
        # HF gives `rope_scaling` precedence over a flat `rope_parameters`.
        kwargs["rope_parameters"] = d.get("rope_scaling") or d.get("rope_parameters")
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> DeepseekV4Config:
        """Read `config.json` at `path` (a file, or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """A `config.json` dict in modern HF spelling; `from_dict(to_dict())` round-trips."""
        d = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "rope_parameters":
                value = {k: v.to_dict() for k, v in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            d[f.name] = value
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        return d


# -------------------------------------------------------------------------------------------------
# Legacy-key folding (spec §2.1; HF 5.23 `DeepseekV4Config.__post_init__`)
# -------------------------------------------------------------------------------------------------


def _compress_rates(d: dict) -> dict[str, int]:
    rates = dict(DEFAULT_COMPRESS_RATES)
    given = d.get("compress_rates")
    if given is not None:
        if not isinstance(given, dict):
            raise ValueError(f"compress_rates: expected a dict layer type -> rate, got {given!r}")
        unknown = [k for k in given if k not in (CSA, HCA)]
        if unknown:
            raise ValueError(f"compress_rates: unknown layer type(s) {unknown}; expected {CSA!r} / {HCA!r}")
        rates.update(given)
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = d["compress_rate_csa"]
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = d["compress_rate_hca"]
    return rates


def _layer_types(d: dict, n: int, rates: dict[str, int]) -> tuple[str, ...]:
    if d.get("layer_types") is not None:
        return tuple(d["layer_types"])
    ratios = d.get("compress_ratios")
    if ratios is None:
        raise ValueError(
            "config: missing required key 'layer_types' (or legacy 'compress_ratios'); the default "
            "schedule differs between releases, so it must come from the checkpoint"
        )
    by_rate = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
    types = []
    # The released list has one trailing entry for the MTP block; HF truncates to n layers too.
    for i, r in enumerate(list(ratios)[:n]):
        if r not in by_rate:
            raise ValueError(f"compress_ratios[{i}]: {r!r} is none of 0, {rates[CSA]} (CSA), {rates[HCA]} (HCA)")
        types.append(by_rate[r])
    return tuple(types)


def _mlp_layer_types(d: dict, n: int) -> tuple[str, ...]:
    if d.get("mlp_layer_types") is not None:
        return tuple(d["mlp_layer_types"])
    n_hash = d.get("num_hash_layers")
    n_hash = DEFAULT_NUM_HASH_LAYERS if n_hash is None else n_hash
    if not isinstance(n_hash, int) or n_hash < 0:
        raise ValueError(f"num_hash_layers: expected an int >= 0, got {n_hash!r}")
    return tuple([HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash))


def _partial_rotary_factor(d: dict) -> float:
    if d.get("partial_rotary_factor") is not None:
        return float(d["partial_rotary_factor"])
    if d.get("qk_rope_head_dim") is not None:
        return d["qk_rope_head_dim"] / d["head_dim"]
    return DEFAULT_PARTIAL_ROTARY_FACTOR


def _quantization_config(d: dict) -> dict | None:
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config: expected a dict, got {q!r}")
    q = dict(q)
    if d.get("expert_dtype") is not None:
        q.setdefault("expert_dtype", d["expert_dtype"])
    return q


def resolve_rope(source: dict | None, config: DeepseekV4Config) -> dict[str, RopeParameters]:
    """Resolve the {"main", "compress"} RoPE sets as HF does (spec §2.3).

    `source` is either the nested HF form {"main": {...}, "compress": {...}} or a flat YaRN dict
    (`rope_scaling` of the released config, or a flat `rope_parameters`); a flat dict applies to the
    compress rope only, the main rope is always plain RoPE with `rope_theta`. `config` needs only
    `partial_rotary_factor`, `rope_theta`, `compress_rope_theta` and `max_position_embeddings`, so
    DeepSeek-V4.1 (same two-rope scheme, deepseek_v41 spec §2.3) resolves its ropes here too.
    """
    prf = config.partial_rotary_factor
    nested = isinstance(source, dict) and all(isinstance(source.get(k), dict) for k in ("main", "compress"))
    if nested:
        return {
            label: _rope_set(f"rope_parameters[{label!r}]", source[label], theta, prf, config)
            for label, theta in (("main", config.rope_theta), ("compress", config.compress_rope_theta))
        }
    if source is not None and not isinstance(source, dict):
        raise ValueError(f"rope_scaling: expected a dict, got {source!r}")
    flat = {k: v for k, v in (source or {}).items() if k not in ("main", "compress")}
    # The compress base always comes from `compress_rope_theta` (HF overrides any flat rope_theta).
    flat["rope_theta"] = config.compress_rope_theta
    main = {"rope_type": "default", "rope_theta": config.rope_theta, "partial_rotary_factor": prf}
    return {
        "main": _rope_set("rope_parameters['main']", main, config.rope_theta, prf, config),
        "compress": _rope_set("rope_scaling", flat, config.compress_rope_theta, prf, config),
    }


def _rope_set(name: str, d: dict, theta: float, prf: float, config: DeepseekV4Config) -> RopeParameters:
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{name}.rope_type: {rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    base = d.get("rope_theta", theta)
    partial = d.get("partial_rotary_factor", prf)
    if rope_type == "default":
        return RopeParameters("default", float(base), float(partial))
    original = d.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{name}.original_max_position_embeddings: required for YaRN")
    factor = d.get("factor")
    if factor is None:
        # HF's fallback when only the two lengths are given.
        factor = config.max_position_embeddings / original
    # V4 never applies the YaRN mscale to cos/sin (spec §2.3), hence the default of 1.
    attention_factor = d.get("attention_factor")
    return RopeParameters(
        "yarn",
        float(base),
        float(partial),
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(d.get("beta_fast") or 32),
        beta_slow=float(d.get("beta_slow") or 1),
        attention_factor=1.0 if attention_factor is None else float(attention_factor),
        truncate=bool(d.get("truncate", True)),
    )


# -------------------------------------------------------------------------------------------------
# Validation (once, at construction)
# -------------------------------------------------------------------------------------------------


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} {why}")


def _validate(c: DeepseekV4Config) -> None:
    for name in REQUIRED_KEYS + ("sliding_window", "hc_mult", "hc_sinkhorn_iters", "index_n_heads",
                                 "index_head_dim", "index_topk", "max_position_embeddings"):
        value = getattr(c, name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
                 "must be a positive int")
    n = c.num_hidden_layers
    for name, types, allowed in (("layer_types", c.layer_types, LAYER_TYPES),
                                 ("mlp_layer_types", c.mlp_layer_types, MLP_LAYER_TYPES)):
        _require(len(types) == n, name, list(types), f"has {len(types)} entries, num_hidden_layers is {n}")
        for i, t in enumerate(types):
            _require(t in allowed, f"{name}[{i}]", t, f"is not one of {allowed}")
    for t in (CSA, HCA):
        rate = c.compress_rates.get(t)
        _require(isinstance(rate, int) and not isinstance(rate, bool) and rate >= 1, f"compress_rates[{t!r}]",
                 rate, "must be a positive int")
    _require(c.num_key_value_heads == 1, "num_key_value_heads", c.num_key_value_heads,
             "must be 1 (DeepSeek-V4 attends with one shared K=V latent)")
    _require(c.n_shared_experts == 1, "n_shared_experts", c.n_shared_experts, "must be 1 (spec §2.1)")
    _require(c.num_attention_heads % c.o_groups == 0, "o_groups", c.o_groups,
             f"must divide num_attention_heads={c.num_attention_heads}")
    _require(c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok", c.num_experts_per_tok,
             f"exceeds n_routed_experts={c.n_routed_experts}")
    _require(c.scoring_func in SCORING_FUNCS, "scoring_func", c.scoring_func, f"is not one of {SCORING_FUNCS}")
    _require(c.hidden_act == "silu", "hidden_act", c.hidden_act, "is not supported (the experts are SwiGLU)")
    for name in ("rms_norm_eps", "hc_eps"):
        value = getattr(c, name)
        _require(isinstance(value, (int, float)) and value >= 0 and math.isfinite(value), name, value,
                 "must be a finite number >= 0")
    _require(c.swiglu_limit >= 0, "swiglu_limit", c.swiglu_limit, "must be >= 0 (0 disables the clamp)")
    for label, rope in c.rope_parameters.items():
        rd = int(c.head_dim * rope.partial_rotary_factor)
        _require(rd % 2 == 0 and 0 < rd <= c.head_dim, f"rope_parameters[{label!r}].partial_rotary_factor",
                 rope.partial_rotary_factor,
                 f"gives {rd} rotary dims; need an even number in (0, head_dim={c.head_dim}]")
        _require(rope.rope_theta > 0, f"rope_parameters[{label!r}].rope_theta", rope.rope_theta, "must be > 0")
        if rope.rope_type == "yarn":
            _require(rope.factor is not None and rope.factor > 0, f"rope_parameters[{label!r}].factor",
                     rope.factor, "must be > 0")
    if CSA in c.layer_types:
        _require(c.qk_rope_head_dim <= c.index_head_dim, "index_head_dim", c.index_head_dim,
                 f"must hold the {c.qk_rope_head_dim} rotary dims of the indexer")
    _require(isinstance(c.num_nextn_predict_layers, int) and c.num_nextn_predict_layers >= 0,
             "num_nextn_predict_layers", c.num_nextn_predict_layers, "must be an int >= 0")
