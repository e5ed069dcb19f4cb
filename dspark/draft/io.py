"""Saving and loading DSpark drafters: on their own, and inside a DeepSeek-V4 checkpoint.

Two homes for the same weights (keys `mtp.{i}.*`, dspark spec §7.1):

* a **drafter directory** (what `dspark train-draft` writes):
      config.json        {"format": "dspark-drafter/1", dspark_* keys, "stage_kind": "v4" | "shipped",
                          "target": {...}}
      model.safetensors  the `mtp.*` tensors, unquantised
      sts.json           optional STS calibration (`dspark.verify.sts.StsCalibration`) of sampled requests
      sts-greedy.json    optional STS calibration of greedy requests (default: sts.json's)
      capacity-<device type>.json   optional capacity tables (`dspark.verify.capacity`) of this drafter
                         with its target on that kind of device ("cpu", "cuda"), drafting rounds
                         priced (`dspark profile --drafter`): the engine's default there;
                         capacity-<type>-sampled.json for sampled rounds, and capacity-cuda-<name>[-sampled].json
                         for the card their conditions name, the default on that card
  `target` records the target's shape-defining fields; loading refuses a target that differs.
  `stage_kind` (`dspark_v4.STAGE_KINDS`; "v4" when absent, as directories written before it) says
  which stage modules the weights belong to: "shipped" for a V4.1 target are V4.1 blocks. For a
  transformers target, whose stage sizes are a load option (`draft_stage`), `stage` records them,
  and loading builds the stages at the recorded sizes whatever the target was loaded with.
* the **target checkpoint** itself, as released (V4-Flash-DSpark): `dspark_*` keys in the target's
  `config.json` and the stages stored as `mtp.0..2`, where a plain V4 checkpoint keeps its MTP
  block. `dspark.load_model` then attaches the drafter as `model.dspark`
  (`dspark_from_checkpoint`); `add_to_checkpoint` writes one such checkpoint (tests, exports).
  A DeepSeek-V4.1 checkpoint ships its stages the same way, as V4.1 blocks (deepseek_v41 spec §9,
  `stages_v41.py`) with MXFP8 32 × 32 dense weights: `dspark_from_v41_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.draft.config import PREFIX, DSparkConfig
from dspark.draft.drafter import DSparkDrafter
from dspark.draft.dspark_v4 import STAGE_KINDS, DSparkModel, target_kernels
from dspark.loader import INDEX_FILE, SINGLE_FILE, SafetensorsReader, load_tensors, plan_sources
from dspark.models.deepseek_v4.checkpoint import encode_tensor, holds_dspark_stages
from dspark.models.deepseek_v41 import checkpoint as v41_checkpoint
from dspark.models.deepseek_v41.config import DeepseekV41Config
from dspark.quant import FP4_BLOCK, V4_DENSE_BLOCK, V41_DENSE_BLOCK
from dspark.verify.capacity import CapacityTable
from dspark.verify.sts import StsCalibration

FORMAT = "dspark-drafter/1"
CONFIG_FILE = "config.json"
STS_FILE = "sts.json"
GREEDY_STS_FILE = "sts-greedy.json"
CAPACITY_PREFIX = "capacity-"
# Target fields a drafter's weights depend on (shapes, features, vocabulary); recorded and checked.
TARGET_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "hc_mult", "head_dim",
                 "num_attention_heads", "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size")


def target_reference(target_config) -> dict:
    """The target fields recorded next to a drafter."""
    return {name: getattr(target_config, name, None) for name in TARGET_FIELDS}


def _stage_shape(target_config):
    """The DSpark stage sizes a target config carries (`hf_causal.DraftStageShape`), or None (DeepSeek
    targets: their stages take the target's own shapes)."""
    return getattr(target_config, "stage", None) if hasattr(target_config, "draft_stage_config") else None


def save_drafter(drafter: DSparkDrafter, path: str | Path) -> None:
    """Write `drafter` as a drafter directory at `path` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT, **drafter.config.to_dict(), "stage_kind": drafter.model.stage_kind,
              "target": target_reference(drafter.target.config)}
    shape = _stage_shape(drafter.model.target_config)
    if shape is not None:
        config["stage"] = dataclasses.asdict(shape)
    tensors = {name: t.detach().cpu().contiguous() for name, t in drafter.model.state_dict().items()}
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if drafter.calibration is not None:
        drafter.calibration.save(path / STS_FILE)
    if drafter.greedy_calibration is not None:
        drafter.greedy_calibration.save(path / GREEDY_STS_FILE)
    for device_type, table in drafter.capacity_tables.items():
        table.save(path / f"{CAPACITY_PREFIX}{device_type}.json")


def load_drafter(path: str | Path, target, dtype: torch.dtype | None = None) -> DSparkDrafter:
    """Load a drafter directory for `target` (the model it was trained on, or one of equal shape).

    The drafter lives on the target's device, in `dtype` (default: the target's; training continues
    in float32), with stages of the recorded `stage_kind` (V4.1 stages take the target's cache QAT);
    `sts.json` and `sts-greedy.json`, when present, set its calibrations (sampled requests', greedy
    requests'). Raises FileNotFoundError for a missing
    directory, ValueError for another format, an unknown stage kind, a target that differs in a
    recorded field (named), or weights that do not match the config.
    """
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a drafter directory (no {CONFIG_FILE})")
    config = json.loads((path / CONFIG_FILE).read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path / CONFIG_FILE}: format {config.get('format')!r}, expected {FORMAT!r}")
    recorded, actual = config.get("target", {}), target_reference(target.config)
    wrong = [f"{k}: drafter trained for {recorded[k]!r}, target has {actual[k]!r}"
             for k in TARGET_FIELDS if k in recorded and recorded[k] != actual[k]]
    if wrong:
        raise ValueError(f"{path}: drafter does not fit this target ({'; '.join(wrong)})")
    stage_kind = config.get("stage_kind", "v4")
    if stage_kind not in STAGE_KINDS:
        raise ValueError(f"{path / CONFIG_FILE}: stage_kind {stage_kind!r} is not one of {STAGE_KINDS}")
    dspark_config = DSparkConfig.from_dict(config)
    model = DSparkModel(dspark_config, _stage_target(target.config, config.get("stage"), path),
                        dtype=dtype or target.dtype, device=target.device,
                        stage_kind=stage_kind, cache_qat=getattr(target, "cache_qat", True),
                        kernels=target_kernels(target)).eval()
    drafter = DSparkDrafter(target, dspark_config, model)
    _load_weights(drafter, path, lambda key: key)
    for name, greedy in ((STS_FILE, False), (GREEDY_STS_FILE, True)):
        if (path / name).is_file():
            drafter.set_calibration(StsCalibration.load(path / name, gamma=drafter.block_size), greedy=greedy)
    drafter.capacity_tables = {f.name[len(CAPACITY_PREFIX):-len(".json")]: CapacityTable.load(f)
                               for f in sorted(path.glob(f"{CAPACITY_PREFIX}*.json"))}
    return drafter


def _stage_target(target_config, stage: dict | None, path: Path):
    """`target_config` with the recorded stage sizes (a transformers target's `DraftStageShape`)."""
    if stage is None or _stage_shape(target_config) is None:
        return target_config
    if not isinstance(stage, dict):
        raise ValueError(f"{path / CONFIG_FILE}: stage must be a dict of DraftStageShape fields, got {stage!r}")
    shape = type(target_config.stage)(**stage).resolved(target_config.hidden_size)
    return dataclasses.replace(target_config, stage=shape)


def _load_weights(drafter: DSparkDrafter, path: Path, rename, block=V4_DENSE_BLOCK) -> None:
    """Every `mtp.*` tensor of `path` into the drafter; all of them must be there."""
    with SafetensorsReader(path) as reader:
        sources, problems = plan_sources(reader, rename, tuple(block), FP4_BLOCK)
        load_tensors(drafter.model.state_dict(keep_vars=True), sources, problems=problems, where=str(path))


# -------------------------------------------------------------------------------------------------
# Inside a target checkpoint
# -------------------------------------------------------------------------------------------------


def dspark_from_checkpoint(model, path: str | Path, config: dict) -> DSparkDrafter | None:
    """The DSpark drafter stored in target checkpoint `path`, or None when it holds none.

    `config` is the checkpoint's `config.json` dict: its `dspark_*` keys configure the drafter, and
    its `mtp.*` tensors are the stages only when `mtp.0.main_proj` exists (else they are the MTP block).
    """
    path = Path(path)
    with SafetensorsReader(path) as reader:
        if not holds_dspark_stages(config, reader.keys()):
            return None
    drafter = DSparkDrafter(model, DSparkConfig.from_dict(config))
    block = (config.get("quantization_config") or {}).get("weight_block_size", V4_DENSE_BLOCK)
    _load_weights(drafter, path, lambda key: key if key.startswith("mtp.") else None, block)
    drafter.model.requires_grad_(False)  # frozen like the target it came with; training unfreezes
    return drafter


def v41_dspark_config(target_config: DeepseekV41Config) -> DSparkConfig:
    """The drafter config of a V4.1 checkpoint: its `dspark_*` fields (the stages' top-k is spelled
    `dspark_num_experts_per_tok` there); window and heads as released (target window, Markov head,
    confidence on [x ; W1[x_{k−1}]])."""
    c = target_config
    return DSparkConfig(dspark_block_size=c.dspark_block_size, dspark_noise_token_id=c.dspark_noise_token_id,
                        dspark_target_layer_ids=tuple(c.dspark_target_layer_ids),
                        dspark_markov_rank=c.dspark_markov_rank, dspark_n_routed_experts=c.dspark_n_routed_experts,
                        dspark_n_activated_experts=c.dspark_num_experts_per_tok)


def _has_dspark_keys(config: dict) -> bool:
    text = config.get("text_config") or {}
    return any(key.startswith(PREFIX) for key in (*config, *text))


def dspark_from_v41_checkpoint(model, path: str | Path, config: dict) -> DSparkDrafter | None:
    """The released DSpark stages of DeepSeek-V4.1 checkpoint `path` as a drafter of `model`, or None.

    A checkpoint holds them when its `config.json` (top level or `text_config`) has `dspark_*` keys
    and `mtp.0.main_proj.weight` is stored. The stages are V4.1 blocks (`DSparkStageV41`), in the
    target's dtype and device, with the target's cache QAT; their FP8 weights use the checkpoint's
    dense block (32 × 32 MXFP8 by default). Raises ValueError naming every missing, unexpected or
    mis-shaped `mtp.*` key.
    """
    path = Path(path)
    with SafetensorsReader(path) as reader:
        if not (_has_dspark_keys(config) and "mtp.0.main_proj.weight" in set(reader.keys())):
            return None
    dspark_config = v41_dspark_config(model.config)
    stages = DSparkModel(dspark_config, model.config, dtype=model.dtype, device=model.device, stage_kind="shipped",
                         cache_qat=getattr(model, "cache_qat", True), kernels=target_kernels(model)).eval()
    drafter = DSparkDrafter(model, dspark_config, stages)
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    block = quant.get("weight_block_size", V41_DENSE_BLOCK)
    _load_weights(drafter, path, lambda key: key if key.startswith("mtp.") else None, block)
    drafter.model.requires_grad_(False)
    return drafter


def add_to_checkpoint(drafter: DSparkDrafter, path: str | Path, quantize: bool = False) -> None:
    """Store `drafter` inside the target checkpoint directory `path` (written by `save_checkpoint`).

    Adds a shard `model-dspark.safetensors` with the stages under `mtp.*` (quantised like the
    release when `quantize`), lists it in the shard index, and merges the `dspark_*` keys into
    `config.json`. The checkpoint must not hold an MTP block: both would claim `mtp.*`. For a V4.1
    target the drafter must have the released V4.1 stages and the target's `dspark_*` fields (its
    `config.json` already has them); tensors are encoded in the V4.1 formats (MXFP8 32 × 32).
    """
    path = Path(path)
    index_file = path / INDEX_FILE
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    else:
        with SafetensorsReader(path) as reader:
            index = {"metadata": {}, "weight_map": dict.fromkeys(reader.keys(), SINGLE_FILE)}
    if any(key.startswith("mtp.") for key in index["weight_map"]):
        raise ValueError(f"{path}: already holds mtp.* tensors; a DSpark checkpoint keeps its stages there")
    v41 = isinstance(drafter.target.config, DeepseekV41Config)
    if v41 and (drafter.model.stage_kind != "shipped" or drafter.config != v41_dspark_config(drafter.target.config)):
        raise ValueError("drafter: a V4.1 checkpoint ships V4.1 stages (stage_kind 'shipped') configured by the "
                         "target's own dspark_* fields")
    encode = v41_checkpoint.encode_tensor if v41 else encode_tensor
    shard = {}
    for name, tensor in drafter.model.state_dict().items():
        shard.update(encode(name, tensor, quantize))
    save_file(shard, str(path / "model-dspark.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(shard, "model-dspark.safetensors"))
    index_file.write_text(json.dumps(index, indent=2) + "\n")
    if v41:
        return  # the V4.1 config.json already carries the (checked) dspark_* fields
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update({k: v for k, v in drafter.config.to_dict().items() if k.startswith(PREFIX)})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
