"""`DeepseekV41Config`: the DeepSeek-V4.1 `config.json`, read once, validated once, frozen.

The released `config.json` is composite (deepseek_v41 spec §2.1): `model_type "deepseek_v41"`, a
`text_config` (`model_type "deepseek_v41_text"`) holding the text model, a `vision_config`, and
top-level `quantization_config` / `image_token_id`. :meth:`DeepseekV41Config.from_dict` accepts that
form and the flat text form. Field names are the released ones (`compress_ratios`,
`kv_source_layer_ids`, `index_source_layer_ids`, `candidate_source_layer_id`, `engram_*`,
`dspark_*`, ...); `engram_pad_token_id` is also read as the official `engram_pad_id`.

The per-layer schedule (spec §2.3-§2.4) is derived once into `layer_roles`: one `LayerRole` per
layer saying which global state it owns (compressor, indexer, index keys) and which it reads.

Defaults are the released V4.1-Flash values for every key outside `REQUIRED_KEYS`, except the
schedule, which (when absent, tiny configs only) is derived as the spec describes: ratios
`[0,0] + [2]*18 + [1]*20` scaled to the depth, KV sources = first layer of each same-ratio run,
index sources = KV sources, candidate source = last KV source.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.models.deepseek_v4.config import RopeParameters, resolve_rope
from dspark.models.deepseek_v41.engram_hash import table_primes
from dspark.models.deepseek_v41.roles import LayerRole, derive_roles, validate_schedule

MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")

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
# Top-level keys of the composite config that the text model reads (spec §2.1).
_TOP_LEVEL_KEYS = ("quantization_config", "image_token_id", "pad_token_id", "bos_token_id", "eos_token_id",
                   "tie_word_embeddings")
_NULLABLE = frozenset({"pad_token_id", "bos_token_id", "eos_token_id", "quantization_config", "image_token_id",
                       "candidate_source_layer_id"})
# Blocks of the quantisation-aware cache formats (spec §11.3): the dims they quantise must divide.
WINDOW_FP8_BLOCK, ENTRY_FP4_BLOCK, INDEX_FP4_BLOCK = 32, 16, 32


@dataclass(frozen=True)
class DeepseekV41Config:
    """DeepSeek-V4.1 hyper-parameters (spec §2). Build with :meth:`from_dict` / :meth:`from_json`.

    Tuples hold the schedule (`compress_ratios` has one entry per backbone layer; the DSpark
    stages' trailing zeros of the released list are checked and dropped); `rope_parameters` is the
    resolved {"main", "compress"} dict (read-only); `layer_roles` is derived, not a config key.
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
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    sliding_window: int = 128
    num_key_value_heads: int = 1
    qk_rope_head_dim: int = 64
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = 1048576
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    topk_method: str = "noaux_tc"
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    image_token_id: int | None = None
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    initializer_range: float = 0.02
    pad_token_id: int | None = 2
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    quantization_config: dict[str, Any] | None = None
    model_type: str = MODEL_TYPE
    layer_roles: tuple[LayerRole, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        rope = self.rope_parameters
        if rope is None or not all(isinstance(v, RopeParameters) for v in rope.values()):
            object.__setattr__(self, "rope_parameters", resolve_rope(rope, self))
        _validate(self)
        validate_schedule(self)
        object.__setattr__(self, "layer_roles", derive_roles(self))

    # ---------------------------------------------------------------------------------------
    # Derived values
    # ---------------------------------------------------------------------------------------

    @property
    def partial_rotary_factor(self) -> float:
        """Rotary share of every head (64 / 512 for Flash); what the shared RoPE code reads."""
        return self.qk_rope_head_dim / self.head_dim

    @property
    def replay_split_layer(self) -> int:
        """First "decoder" layer of bounded replay (spec §6.1): the last KV source (20 in Flash).

        Every global entry any later layer reads is published by this layer from its attention
        input, so layers before it plus this layer's global projections fix all global state.
        `num_hidden_layers` when there is no KV source (nothing to split).
        """
        return self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else self.num_hidden_layers

    def rope_for(self, layer_id: int) -> RopeParameters:
        """The layer's RoPE set: "compress" (θ 160000 + YaRN) for any ratio > 0, else "main" (§2.3)."""
        return self.rope_parameters[self.layer_roles[layer_id].rope]

    # ---------------------------------------------------------------------------------------
    # Construction from / to config.json
    # ---------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV41Config:
        """Build from a released (composite) or flat `config.json` dict.

        Unknown keys (`architectures`, `vision_config`, `transformers_version`, ...) are ignored.
        Raises ValueError naming a missing required key or any invalid value.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a dict, got {type(d).__name__}")
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type not in (MODEL_TYPE, TEXT_MODEL_TYPE):
            raise ValueError(f"model_type: expected {MODEL_TYPE!r}, got {model_type!r}")
        text = d.get("text_config")
        if text is not None:
            if not isinstance(text, dict):
                raise ValueError(f"text_config: expected a dict, got {text!r}")
            flat = dict(text)
            for key in _TOP_LEVEL_KEYS:
                if key in d and key not in flat:
                    flat[key] = d[key]
            d = flat
        missing = [k for k in REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ValueError(f"config: missing required key(s) {missing}")
        if d.get("num_hash_layers"):
            raise ValueError(f"num_hash_layers: {d['num_hash_layers']!r}; DeepSeek-V4.1 has no hash-routed layers")

        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {k: v for k, v in d.items() if k in names and (v is not None or k in _NULLABLE)}
        kwargs.pop("model_type", None)
        if "engram_pad_id" not in kwargs and d.get("engram_pad_token_id") is not None:
            kwargs["engram_pad_id"] = d["engram_pad_token_id"]
        kwargs["rope_parameters"] = d.get("rope_scaling") or d.get("rope_parameters")
        kwargs.update(_schedule(d))
        kwargs.update(_engram_defaults(d, kwargs))
        if "dspark_target_layer_ids" not in kwargs:
            kwargs["dspark_target_layer_ids"] = _default_dspark_targets(int(d["num_hidden_layers"]),
                                                                       kwargs["kv_source_layer_ids"])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> DeepseekV41Config:
        """Read `config.json` at `path` (a file, or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The released composite form; `from_dict(to_dict())` round-trips."""
        text: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if not f.init or f.name in _TOP_LEVEL_KEYS:
                continue
            value = getattr(self, f.name)
            if f.name == "rope_parameters":
                value = {k: v.to_dict() for k, v in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            text[f.name] = value
        text["model_type"] = TEXT_MODEL_TYPE
        top = {key: getattr(self, key) for key in _TOP_LEVEL_KEYS}
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": MODEL_TYPE, **top, "text_config": text}


# -------------------------------------------------------------------------------------------------
# Schedule and Engram defaults (spec §2.4, §8.2)
# -------------------------------------------------------------------------------------------------


def default_compress_ratios(n: int) -> list[int]:
    """The released pattern `[0,0] + [2]*18 + [1]*20` scaled to `n` layers.

    Two SWA layers, then ratio 2 up to the CED split at ⌈n/2⌉ (the encoder is the first half,
    spec §6.1), ratio 1 after it: exactly the release at n = 40 (HF41's formula needs a special
    case there), e.g. `[0,0,2,2,1,1,1]` at n = 7.
    """
    n_swa, n_encoder = min(2, n), (n + 1) // 2
    return [0] * n_swa + [2] * max(0, n_encoder - n_swa) + [1] * (n - max(n_swa, n_encoder))


def _schedule(d: dict) -> dict[str, Any]:
    n = int(d["num_hidden_layers"])
    n_stages = d.get("num_nextn_predict_layers")
    n_stages = 3 if n_stages is None else n_stages
    ratios = d.get("compress_ratios")
    ratios = default_compress_ratios(n) if ratios is None else list(ratios)
    if not isinstance(n_stages, int) or not n <= len(ratios) <= n + n_stages:
        raise ValueError(f"compress_ratios: {len(ratios)} entries; expected num_hidden_layers={n} "
                         f"(+ up to num_nextn_predict_layers={n_stages} DSpark-stage entries)")
    if any(r != 0 for r in ratios[n:]):
        raise ValueError(f"compress_ratios[{n}:]: {ratios[n:]}; the DSpark stages are sliding-window only (0)")
    ratios = ratios[:n]
    kv = d.get("kv_source_layer_ids")
    if kv is None:  # first layer of each same-ratio run of compressed layers
        kv = [i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i])]
    index = d.get("index_source_layer_ids")
    index = list(kv) if index is None else index
    candidate = d.get("candidate_source_layer_id")
    if candidate is None:
        candidate = kv[-1] if len(kv) else -1
    return dict(compress_ratios=ratios, kv_source_layer_ids=kv, index_source_layer_ids=index,
                candidate_source_layer_id=candidate)


def _engram_defaults(d: dict, kwargs: dict) -> dict[str, Any]:
    """`engram_num_embeddings` defaults to the prime sums (they must equal them, spec §8.2)."""
    if d.get("engram_num_embeddings") is not None:
        return {}
    layer_ids = kwargs.get("engram_layer_ids") or ()
    primes = table_primes(len(layer_ids), kwargs.get("engram_max_ngram_size", 4), kwargs.get("engram_n_heads", 8),
                          kwargs.get("engram_vocab_size", 16000000))
    return {"engram_num_embeddings": [sum(p for order in layer for p in order) for layer in primes]}


def _default_dspark_targets(n: int, kv_sources) -> list[int]:
    """The last three non-KV-source layers (released: 37, 38, 39)."""
    return sorted(i for i in range(n) if i not in set(kv_sources))[-3:]


# -------------------------------------------------------------------------------------------------
# Validation (once, at construction)
# -------------------------------------------------------------------------------------------------


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} {why}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _validate(c: DeepseekV41Config) -> None:
    for name in REQUIRED_KEYS + ("sliding_window", "hc_mult", "hc_sinkhorn_iters", "index_n_heads", "index_head_dim",
                                 "index_topk", "max_position_embeddings", "candidate_topk_blocks",
                                 "candidate_block_size", "qk_rope_head_dim"):
        _require(_positive_int(getattr(c, name)), name, getattr(c, name), "must be a positive int")
    _require(c.num_key_value_heads == 1, "num_key_value_heads", c.num_key_value_heads,
             "must be 1 (one shared K = V latent, spec §5.1)")
    _require(c.n_shared_experts == 1, "n_shared_experts", c.n_shared_experts, "must be 1 (spec §7)")
    _require(c.num_attention_heads % c.o_groups == 0, "o_groups", c.o_groups,
             f"must divide num_attention_heads={c.num_attention_heads}")
    _require(c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok", c.num_experts_per_tok,
             f"exceeds n_routed_experts={c.n_routed_experts}")
    _require(c.scoring_func in SCORING_FUNCS, "scoring_func", c.scoring_func, f"is not one of {SCORING_FUNCS}")
    _require(c.hidden_act == "silu", "hidden_act", c.hidden_act, "is not supported (the experts are SwiGLU)")
    _require(isinstance(c.gate_temp, (int, float)) and c.gate_temp > 0, "gate_temp", c.gate_temp, "must be > 0")
    for name in ("rms_norm_eps", "hc_eps"):
        value = getattr(c, name)
        _require(isinstance(value, (int, float)) and value >= 0 and math.isfinite(value), name, value,
                 "must be a finite number >= 0")
    _require(c.swiglu_limit >= 0, "swiglu_limit", c.swiglu_limit, "must be >= 0 (0 disables the clamp)")
    _require(c.qk_rope_head_dim % 2 == 0 and c.qk_rope_head_dim <= min(c.head_dim, c.index_head_dim),
             "qk_rope_head_dim", c.qk_rope_head_dim,
             f"must be even and fit head_dim={c.head_dim} and index_head_dim={c.index_head_dim}")
    # The QAT cache formats are part of the model (spec §11.3): their blocks must tile the vectors.
    _require(c.head_dim % WINDOW_FP8_BLOCK == 0, "head_dim", c.head_dim,
             f"must be a multiple of {WINDOW_FP8_BLOCK} (FP8 window-KV blocks; FP4 entry blocks of "
             f"{ENTRY_FP4_BLOCK})")
    _require(c.index_head_dim % INDEX_FP4_BLOCK == 0, "index_head_dim", c.index_head_dim,
             f"must be a multiple of {INDEX_FP4_BLOCK} (FP4 index-key blocks)")
    for label, rope in c.rope_parameters.items():
        _require(rope.rope_theta > 0, f"rope_parameters[{label!r}].rope_theta", rope.rope_theta, "must be > 0")
    _validate_engram(c)
    _require(isinstance(c.num_nextn_predict_layers, int) and c.num_nextn_predict_layers >= 0,
             "num_nextn_predict_layers", c.num_nextn_predict_layers, "must be an int >= 0")
    bad = [i for i in c.dspark_target_layer_ids if not 0 <= i < c.num_hidden_layers]
    _require(not bad, "dspark_target_layer_ids", list(c.dspark_target_layer_ids),
             f"has ids outside [0, {c.num_hidden_layers})")
    if c.image_token_id is not None:
        _require(0 <= c.image_token_id < c.vocab_size, "image_token_id", c.image_token_id,
                 f"is outside the vocabulary [0, {c.vocab_size})")


def _validate_engram(c: DeepseekV41Config) -> None:
    ids = c.engram_layer_ids
    _require(len(set(ids)) == len(ids) and all(isinstance(i, int) and 0 <= i < c.num_hidden_layers for i in ids),
             "engram_layer_ids", list(ids), f"must be distinct layer ids in [0, {c.num_hidden_layers})")
    if not ids:
        return
    for name in ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
                 "engram_compressed_vocab_size"):
        _require(_positive_int(getattr(c, name)), name, getattr(c, name), "must be a positive int")
    _require(c.engram_max_ngram_size >= 2, "engram_max_ngram_size", c.engram_max_ngram_size,
             "must be >= 2 (orders 2..N are hashed)")
    _require(0 <= c.engram_pad_id < c.vocab_size, "engram_pad_id", c.engram_pad_id,
             f"is outside the vocabulary [0, {c.vocab_size})")
    primes = table_primes(len(ids), c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
    expected = [sum(p for order in layer for p in order) for layer in primes]
    _require(list(c.engram_num_embeddings) == expected, "engram_num_embeddings", list(c.engram_num_embeddings),
             f"must equal the prime table sizes {expected} of engram_layer_ids={list(ids)} (spec §8.2)")
