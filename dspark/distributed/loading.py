"""Sharded loading: each rank reads only the tensors it holds after `parallelize`.

`load_sharded` builds the model on the meta device (`deferred.py`), swaps in the parallel MoE
blocks (dropping the experts other ranks own), allocates what is left (`build_sharded`: a rank
never allocates another rank's experts), then plans the checkpoint from its safetensors headers and
copies only the tensors this rank's model has: a routed expert owned by another rank is renamed to
"ignored" before planning, so its FP4 data and scales are never read; under "tp" the split tensors
are read as this rank's slices; with `engram_shard` each Engram table is read as this rank's row
range (with its scale rows). Everything else (router, embeddings, head, Engram tables without
`engram_shard`, and the attention and shared expert outside "tp") is replicated and read by every
rank.

Supported: DeepSeek-V4 and V4.1 checkpoints in the official layout (quantised or not), for the
"dep", "ep" and "tp" layouts. Under "tp" the split tensors (attention heads, expert widths) are read
as slices (`tp_loading.plan_split_sources`): each rank reads 1/t of them, quantised ones with their
scale blocks. transformers' own layout (merged experts) is translated as a whole state dict by the
single-process loader and is refused here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dspark.api import CONFIG_FILE, DRAFTER_DIR, EMBEDDED, build_model, load_tokenizer
from dspark.distributed.comm import Comm
from dspark.distributed.config import ParallelConfig
from dspark.distributed.deferred import deferred_weights, materialize
from dspark.distributed.engram_shard import owned_rows
from dspark.distributed.shard import parallelize
from dspark.distributed.tp_loading import decoded_shape, plan_split_sources, range_source
from dspark.draft.io import dspark_from_checkpoint, dspark_from_v41_checkpoint, load_drafter
from dspark.loader import SafetensorsReader, load_tensors, plan_sources
from dspark.models.deepseek_v4 import checkpoint as v4
from dspark.models.deepseek_v41 import checkpoint as v41
from dspark.quant import ENGRAM_BLOCK, FP4_BLOCK, V4_DENSE_BLOCK, V41_DENSE_BLOCK

_ROUTED = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.")


def load_sharded(path: str | Path, parallel: ParallelConfig, comm: Comm, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, **options) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """`dspark.load_model` for one rank of a parallel run; returns (model, parallel MoE layers).

    `path` is a checkpoint directory or an embedded model name ("tiny"). The model carries its
    tokenizer and its DSpark drafter (`model.dspark`, replicated on every rank) like `load_model`.
    Raises ValueError naming every missing, unexpected or mis-shaped key, and for the HF layout.
    """
    path = EMBEDDED[path] if isinstance(path, str) and path in EMBEDDED else Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    model, moe_layers = build_sharded(config, parallel, comm, device, dtype, **options)
    if config.get("model_type") == "deepseek_v41":
        _load_v41(model, path, config, parallel)
        model.dspark = dspark_from_v41_checkpoint(model, path, config)
    else:
        _load_v4(model, path, config, parallel)
        model.dspark = dspark_from_checkpoint(model, path, config)
    model.tokenizer = load_tokenizer(path)
    if (path / DRAFTER_DIR / CONFIG_FILE).is_file():
        model.dspark = load_drafter(path / DRAFTER_DIR, model)
    return model.eval().requires_grad_(False), moe_layers


def build_sharded(config: dict, parallel: ParallelConfig, comm: Comm, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, **options) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """This rank's model of a `config.json` dict, parallelised, with uninitialised weights; returns
    (model, parallel MoE layers). Built on the meta device first (`deferred_weights`), so only the
    tensors this rank keeps are ever allocated: its E / ep routed experts per layer, not all E, and
    with `engram_shard` its rows of each Engram table, wherever the tables live."""
    with deferred_weights(device, host=parallel.engram_shard):
        model = build_model(config, device, dtype, **options)
    moe_layers = parallelize(model, parallel, comm)
    return materialize(model, device), moe_layers


def _owned_only(rename, held: set[str]):
    """Wrap a checkpoint rename so that routed experts this rank does not hold are ignored."""
    def owned(key: str) -> str | None:
        name = rename(key)
        return None if name is not None and _ROUTED.match(name) and name not in held else name
    return owned


def _plan(reader, rename, fp8_block, fp4_block, parallel: ParallelConfig):
    """`plan_sources`, or under "tp" its slicing version (this rank's blocks of the split tensors)."""
    if parallel.layout == "tp":
        return plan_split_sources(reader, rename, fp8_block, fp4_block, parallel.rank, parallel.world_size)
    return plan_sources(reader, rename, fp8_block, fp4_block)


def _load_v4(model, path: Path, config: dict, parallel: ParallelConfig) -> None:
    """DeepSeek-V4 official / hf_saved layouts (the rules of `deepseek_v4.checkpoint.load_checkpoint`)."""
    block = tuple((config.get("quantization_config") or {}).get("weight_block_size", V4_DENSE_BLOCK))
    tensors = model.state_dict(keep_vars=True)
    with SafetensorsReader(path) as reader:
        layout = v4.detect_layout(reader.keys())
        if layout == "hf":
            raise ValueError(f"{path}: sharded loading needs the official layout, not transformers' merged experts")
        rename = _owned_only(lambda key: v4.official_name(key, layout), set(tensors))
        sources, problems = _plan(reader, rename, block, FP4_BLOCK, parallel)
        if v4.holds_dspark_stages(config, sources):  # the stages belong to the drafter
            sources = {n: s for n, s in sources.items() if not n.startswith("mtp.")}
            problems = {n: p for n, p in problems.items() if not n.startswith("mtp.")}
        has_mtp = any(name.startswith("mtp.") for name in sources)
        load_tensors(tensors, sources, lambda name: not has_mtp and name.startswith("mtp."), problems, str(path))
    if not has_mtp and len(model.mtp):
        _zero_mtp(model)
    problems = v4.routing_table_problems(tensors)
    if problems:
        raise ValueError(f"cannot load {path}:\n  " + "\n  ".join(problems))
    model.has_mtp = has_mtp


def _zero_mtp(model) -> None:
    """An MTP block the checkpoint lacks is zeroed rather than left as uninitialised memory; with
    `has_mtp` False no drafter uses it (the single-process loader seeds it instead)."""
    with torch.no_grad():
        for tensor in model.mtp.state_dict(keep_vars=True).values():
            tensor.zero_()


def _load_v41(model, path: Path, config: dict, parallel: ParallelConfig) -> None:
    """DeepSeek-V4.1 official layout (the rules of `deepseek_v41.checkpoint.load_checkpoint`)."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    dense = tuple(quant.get("weight_block_size", V41_DENSE_BLOCK))

    def fp8_block(key: str) -> tuple[int, int]:
        return ENGRAM_BLOCK if v41.disk_format(key) == v41.FP8_ROWS else dense

    tensors = model.state_dict(keep_vars=True)
    with SafetensorsReader(path) as reader:
        sources, problems = _plan(reader, _owned_only(v41.official_name, set(tensors)), fp8_block, FP4_BLOCK, parallel)
        if parallel.engram_shard:
            _plan_engram_rows(reader, sources, problems, fp8_block, parallel)
        load_tensors(tensors, sources, problems=problems, where=str(path))
    tokenizer_file = path / "tokenizer.json"
    if tokenizer_file.is_file() and model.engram_ids:
        from tokenizers import Tokenizer

        model.bind_tokenizer(Tokenizer.from_file(str(tokenizer_file)))


def _plan_engram_rows(reader, sources: dict, problems: dict, fp8_block, parallel: ParallelConfig) -> None:
    """Re-plan every Engram table (`*.engram.embed.weight`) as this rank's row range (`owned_rows`,
    as `ShardedEngramTable` holds it), in place: FP8 rows with their 1 × 32 scale rows."""
    for key in reader.keys():
        name = v41.official_name(key)
        if name is None or v41.disk_format(name) != v41.FP8_ROWS:
            continue
        rows = owned_rows(decoded_shape(reader, key)[0], parallel.rank, parallel.world_size)
        source, problem = range_source(reader, key, 0, rows.start, rows.stop, fp8_block(key), FP4_BLOCK)
        sources.pop(name, None)
        problems.pop(name, None)
        if problem:
            problems[name] = problem
        else:
            sources[name] = source
