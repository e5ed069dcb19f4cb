"""Translate between HF `transformers` DeepSeek-V4 state dicts and the official checkpoint keys.

Our parameter names are the official keys (docs/design.md). HF 5.23 renames them (spec §13.3) and
merges the routed experts of a layer into two 3-D tensors:

    official  layers.{i}.ffn.experts.{e}.w1.weight [I, D]   \\
              layers.{i}.ffn.experts.{e}.w3.weight [I, D]   -> HF  model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, D]
              layers.{i}.ffn.experts.{e}.w2.weight [D, I]   -> HF  model.layers.{i}.mlp.experts.down_proj    [E, D, I]

Block scales of quantised weights follow their weight: official `X.scale` <-> HF `Y.weight_scale_inv`
(HF's name is historical: both multiply), merged expert scales `gate_up_proj_scale_inv` split
in two halves along dim 1 like the weight. The mHC parameters `hc_*_scale` are not block scales.

HF does not instantiate the MTP block, so `official_to_hf` leaves `mtp.*` out; every other key
must map, or a ValueError names the keys that do not.
"""

from __future__ import annotations

import re

import torch

# (official, HF) leaf names inside one layer; `layers.{i}.` <-> `model.layers.{i}.` is added around them.
_LAYER_NAMES = (
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
)
_GLOBAL_NAMES = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
)
_TO_HF = {off: hf for off, hf in _LAYER_NAMES}
_TO_OFFICIAL = {hf: off for off, hf in _LAYER_NAMES}
_GLOBAL_TO_HF = dict(_GLOBAL_NAMES)
_GLOBAL_TO_OFFICIAL = {hf: off for off, hf in _GLOBAL_NAMES}

_OFFICIAL_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OFFICIAL_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_HF_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")


def official_to_hf_name(name: str) -> str | None:
    """HF name of a non-expert official key, or None if it has none (block scales included)."""
    if name.endswith(".scale"):
        weight = official_to_hf_name(name[: -len("scale")] + "weight")
        return None if weight is None else weight + "_scale_inv"
    if name in _GLOBAL_TO_HF:
        return _GLOBAL_TO_HF[name]
    m = _OFFICIAL_LAYER.match(name)
    if m and m.group(2) in _TO_HF:
        return f"model.layers.{m.group(1)}.{_TO_HF[m.group(2)]}"
    return None


def hf_to_official_name(name: str) -> str | None:
    """Official name of a non-expert HF key, or None if it has none."""
    if name.endswith(".weight_scale_inv"):
        weight = hf_to_official_name(name[: -len("_scale_inv")])
        return None if weight is None else weight[: -len("weight")] + "scale"
    if name in _GLOBAL_TO_OFFICIAL:
        return _GLOBAL_TO_OFFICIAL[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _TO_OFFICIAL:
        return f"layers.{m.group(1)}.{_TO_OFFICIAL[m.group(2)]}"
    return None


def hf_to_official(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official-key state dict from an HF `DeepseekV4ForCausalLM.state_dict()` (experts split, cloned)."""
    out: dict[str, torch.Tensor] = {}
    unmapped = []
    for name, tensor in state_dict.items():
        m = _HF_EXPERTS.match(name)
        if m:
            out.update(_split_experts(int(m.group(1)), m.group(2), m.group(3) is not None, tensor, name))
            continue
        official = hf_to_official_name(name)
        if official is None:
            unmapped.append(name)
        else:
            out[official] = tensor
    _raise_unmapped(unmapped, "HF", "official")
    return out


def official_to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-name state dict from official keys (experts merged per layer; `mtp.*` left out)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[tuple[int, str], torch.Tensor]] = {}
    unmapped = []
    for name, tensor in state_dict.items():
        if name.startswith("mtp."):
            continue
        m = _OFFICIAL_EXPERT.match(name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(4)), {})[(int(m.group(2)), m.group(3))] = tensor
            continue
        hf = official_to_hf_name(name)
        if hf is None:
            unmapped.append(name)
        else:
            out[hf] = tensor
    _raise_unmapped(unmapped, "official", "HF")
    for (layer, kind), tensors in sorted(experts.items()):
        out.update(_merge_experts(layer, kind, tensors))
    return out


def _split_experts(layer: int, proj: str, is_scale: bool, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """gate_up_proj [E, 2I, D] -> w1 = [:, :I], w3 = [:, I:]; down_proj [E, D, I] -> w2."""
    leaf = "scale" if is_scale else "weight"
    prefix = f"layers.{layer}.ffn.experts"
    if proj == "down_proj":
        return {f"{prefix}.{e}.w2.{leaf}": tensor[e].clone() for e in range(tensor.shape[0])}
    if tensor.dim() != 3 or tensor.shape[1] % 2:
        raise ValueError(f"{name}: expected [E, 2I, ...] with an even middle dim, got {tuple(tensor.shape)}")
    half = tensor.shape[1] // 2
    out = {}
    for e in range(tensor.shape[0]):
        out[f"{prefix}.{e}.w1.{leaf}"] = tensor[e, :half].clone()
        out[f"{prefix}.{e}.w3.{leaf}"] = tensor[e, half:].clone()
    return out


def _merge_experts(layer: int, leaf: str, tensors: dict[tuple[int, str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack experts 0..E−1 of one layer into HF's gate_up_proj / down_proj (or their scales)."""
    n_experts = 1 + max(e for e, _ in tensors)
    missing = [f"layers.{layer}.ffn.experts.{e}.{w}.{leaf}" for e in range(n_experts) for w in ("w1", "w2", "w3")
               if (e, w) not in tensors]
    if missing:
        raise ValueError(f"cannot merge experts of layer {layer}: missing {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    suffix = "" if leaf == "weight" else "_scale_inv"
    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up = torch.stack([torch.cat((tensors[(e, "w1")], tensors[(e, "w3")])) for e in range(n_experts)])
    down = torch.stack([tensors[(e, "w2")] for e in range(n_experts)])
    return {f"{prefix}.gate_up_proj{suffix}": gate_up, f"{prefix}.down_proj{suffix}": down}


def _raise_unmapped(names: list[str], source: str, target: str) -> None:
    if names:
        shown = ", ".join(sorted(names)[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise ValueError(f"{len(names)} {source} key(s) have no {target} name: {shown}")
