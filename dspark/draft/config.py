"""`DSparkConfig`: the DSpark drafter's knobs, named as in the DeepSeek-V4 checkpoint config.

The released V4-Flash-DSpark `config.json` carries the drafter's settings next to the target's as
`dspark_*` keys (dspark spec §7.1): `dspark_block_size` γ = 5, `dspark_noise_token_id` = 128799,
`dspark_target_layer_ids` = [40, 41, 42], `dspark_markov_rank` = 256; V4.1 adds
`dspark_n_routed_experts` / `dspark_n_activated_experts` for the stages' MoE (spelled
`dspark_num_experts_per_tok` in the V4.1 release; `from_dict` reads both). The remaining keys
(head type, confidence input, window) have no checkpoint spelling; they follow DeepSpec's names
with the same prefix. One stage is built per target layer id (spec §8: three stages `mtp.0..2`).

Values that depend on the target (vocabulary, number of layers) are checked by `check_target`, when
a drafter is built for a concrete target.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

HEAD_TYPES = ("markov", "rnn")
V4_NOISE_TOKEN_ID = 128799
PREFIX = "dspark_"
# Other spellings of a field: the V4.1 `config.json` names the stages' top-k like the target's.
ALIASES = {"dspark_num_experts_per_tok": "dspark_n_activated_experts"}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} {why}")


@dataclass(frozen=True)
class DSparkConfig:
    """DSpark drafter hyper-parameters (dspark spec §1, §7).

    dspark_block_size : γ, drafted tokens per round; the block is [anchor, noise × (γ−1)].
    dspark_noise_token_id : id whose (frozen target) embedding fills the γ−1 mask slots.
    dspark_target_layer_ids : target layers whose *input* streams feed the context (stream-mean,
        concatenated); id = num_hidden_layers means the final streams. One stage per id.
    dspark_markov_rank : r of the Markov head (W1 [V, r], W2 [V, r]).
    dspark_n_routed_experts, dspark_n_activated_experts : the stages' MoE size and top-k; None
        takes the target's.
    dspark_markov_head_type : "markov" (bias W2·W1[x_{k−1}]) or "rnn" (spec §1.6, eq. 6).
    dspark_confidence_with_markov : confidence input [x ; W1[x_{k−1}]] (True) or x alone.
    dspark_sliding_window : W, committed context rows a block sees; None takes the target's
        `sliding_window` (128 for V4).
    """

    dspark_block_size: int = 5
    dspark_noise_token_id: int = V4_NOISE_TOKEN_ID
    dspark_target_layer_ids: tuple[int, ...] = (40, 41, 42)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int | None = None
    dspark_n_activated_experts: int | None = None
    dspark_markov_head_type: str = "markov"
    dspark_confidence_with_markov: bool = True
    dspark_sliding_window: int | None = None

    def __post_init__(self):
        ids = self.dspark_target_layer_ids
        _require(isinstance(ids, (list, tuple)), "dspark_target_layer_ids", ids, "must be a list of ints")
        object.__setattr__(self, "dspark_target_layer_ids", tuple(ids))
        _validate(self)

    @property
    def num_stages(self) -> int:
        return len(self.dspark_target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.dspark_block_size

    # ---------------------------------------------------------------------------------------
    # Construction
    # ---------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DSparkConfig:
        """Read the `dspark_*` keys of a (target or drafter) config dict; other keys are ignored."""
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        for alias, name in ALIASES.items():  # the V4.1 release's spellings
            if alias in d and name not in kwargs:
                kwargs[name] = d[alias]
        return cls(**kwargs)

    @classmethod
    def for_target(cls, target_config, **overrides) -> DSparkConfig:
        """Defaults fitted to `target_config` (a `DeepseekV4Config`, or a config with `dspark_defaults()`),
        then `overrides`.

        Target layers: the inputs of the last three layers (V4-Flash: 40, 41, 42 of 43). Noise token:
        V4's 128799 when the vocabulary holds it, else the last id (any fixed id works: its embedding
        is frozen and only marks "unknown").
        """
        n = target_config.num_hidden_layers
        vocab = target_config.vocab_size
        defaults = dict(
            dspark_target_layer_ids=tuple(range(max(0, n - 3), n)),
            dspark_noise_token_id=V4_NOISE_TOKEN_ID if V4_NOISE_TOKEN_ID < vocab else vocab - 1,
        )
        if hasattr(target_config, "dspark_defaults"):  # a non-DeepSeek target's own (hf_causal: γ = 7, ...)
            defaults.update(target_config.dspark_defaults())
        return cls(**{**defaults, **overrides})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        return d

    # ---------------------------------------------------------------------------------------
    # Target-dependent checks
    # ---------------------------------------------------------------------------------------

    def check_target(self, target_config) -> None:
        """Raise ValueError naming the field that does not fit `target_config`."""
        vocab, n = target_config.vocab_size, target_config.num_hidden_layers
        _require(self.dspark_noise_token_id < vocab, "dspark_noise_token_id", self.dspark_noise_token_id,
                 f"is outside the target vocabulary [0, {vocab})")
        bad = [i for i in self.dspark_target_layer_ids if i > n]
        _require(not bad, "dspark_target_layer_ids", list(self.dspark_target_layer_ids),
                 f"name layer(s) {bad} beyond the target's num_hidden_layers={n}")
        experts = self.n_routed_experts(target_config)
        _require(self.n_activated_experts(target_config) <= experts, "dspark_n_activated_experts",
                 self.n_activated_experts(target_config), f"exceeds the stages' {experts} routed experts")

    def n_routed_experts(self, target_config) -> int:
        return self.dspark_n_routed_experts or target_config.n_routed_experts

    def n_activated_experts(self, target_config) -> int:
        return self.dspark_n_activated_experts or target_config.num_experts_per_tok

    def window(self, target_config) -> int:
        return self.dspark_sliding_window or target_config.sliding_window


def _validate(c: DSparkConfig) -> None:
    for name in ("dspark_block_size", "dspark_markov_rank"):
        value = getattr(c, name)
        _require(_is_int(value) and value >= 1, name, value, "must be an int >= 1")
    _require(_is_int(c.dspark_noise_token_id) and c.dspark_noise_token_id >= 0, "dspark_noise_token_id",
             c.dspark_noise_token_id, "must be an int >= 0")
    ids = c.dspark_target_layer_ids
    _require(len(ids) >= 1 and all(_is_int(i) and i >= 0 for i in ids), "dspark_target_layer_ids", list(ids),
             "must be a non-empty list of layer ids >= 0")
    _require(all(a < b for a, b in zip(ids, ids[1:])), "dspark_target_layer_ids", list(ids),
             "must be strictly increasing")
    for name in ("dspark_n_routed_experts", "dspark_n_activated_experts", "dspark_sliding_window"):
        value = getattr(c, name)
        _require(value is None or (_is_int(value) and value >= 1), name, value, "must be None or an int >= 1")
    if c.dspark_n_routed_experts is not None and c.dspark_n_activated_experts is not None:
        _require(c.dspark_n_activated_experts <= c.dspark_n_routed_experts, "dspark_n_activated_experts",
                 c.dspark_n_activated_experts, f"exceeds dspark_n_routed_experts={c.dspark_n_routed_experts}")
    _require(c.dspark_markov_head_type in HEAD_TYPES, "dspark_markov_head_type", c.dspark_markov_head_type,
             f"is not one of {HEAD_TYPES}")
    _require(isinstance(c.dspark_confidence_with_markov, bool), "dspark_confidence_with_markov",
             c.dspark_confidence_with_markov, "must be a bool")
