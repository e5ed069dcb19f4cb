"""Sharded loading for the "tp" layout: each rank reads only its slice of every split tensor.

`parallelize` under "tp" keeps, per target layer, a contiguous block of 1/t of these tensors
(see attention.py and `ColumnMoE`), always block r of t along one axis:

    axis 0 (rows)     attn.wq_b.weight, attn.wo_a.weight, attn.attn_sink,
                      ffn.{experts.e, shared_experts}.{w1, w3}.weight
    axis 1 (columns)  attn.wo_b.weight, ffn.{experts.e, shared_experts}.w2.weight

`plan_split_sources` plans them as slices read straight from the safetensors file
(`SafetensorsReader.get_part`: safetensors' `get_slice`), everything else as `plan_sources` does.
Quantised weights are sliced in their stored form with the matching rows or columns of their block
scales and dequantised per slice, which needs the cut to fall on a scale block boundary (FP8
128×128 / 32×32 blocks, FP4 1×32 blocks of two values per byte); a cut inside a block is
reported as a problem naming the tensor. `range_source` reads any range along one axis; the
sharded Engram tables (`engram_shard`, any layout) use it for their row ranges.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from dspark.loader import SafetensorsReader, TensorSource, plan_sources, quant_codec, scale_key
from dspark.quant import block_grid, dequantize

_ROWS = re.compile(r"^layers\.\d+\.(attn\.(wq_b\.weight|wo_a\.weight|attn_sink)"
                   r"|ffn\.(experts\.\d+|shared_experts)\.(w1|w3)\.weight)$")
_COLUMNS = re.compile(r"^layers\.\d+\.(attn\.wo_b|ffn\.(experts\.\d+|shared_experts)\.w2)\.weight$")


def split_axis(name: str | None) -> int | None:
    """The axis along which "tp" splits the model tensor `name`, or None when it is replicated."""
    if name is None:
        return None
    return 0 if _ROWS.match(name) else 1 if _COLUMNS.match(name) else None


def plan_split_sources(reader: SafetensorsReader, rename: Callable[[str], str | None],
                       fp8_block: tuple[int, int] | Callable[[str], tuple[int, int]], fp4_block: tuple[int, int],
                       rank: int, size: int) -> tuple[dict[str, TensorSource], dict[str, str]]:
    """`plan_sources` for rank `rank` of a "tp" group of `size`: split tensors become sources of
    this rank's slice (shape and bytes read: 1/size of the tensor). Headers only."""
    sources, problems = plan_sources(reader, lambda key: None if split_axis(rename(key)) is not None else rename(key),
                                     fp8_block, fp4_block)
    for key in reader.keys():
        name = rename(key)
        axis = split_axis(name)
        if axis is None:
            continue
        block = fp8_block(key) if callable(fp8_block) else fp8_block
        source, problem = _slice_source(reader, key, axis, rank, size, block, fp4_block)
        if problem:
            problems[name] = problem
        else:
            sources[name] = source
    return sources, problems


def _slice_source(reader: SafetensorsReader, key: str, axis: int, rank: int, size: int,
                  fp8_block: tuple[int, int], fp4_block: tuple[int, int]) -> tuple[TensorSource | None, str | None]:
    """Block `rank` of `size` equal blocks of `key` along `axis` (decoded coordinates), or a problem."""
    shape = decoded_shape(reader, key)
    if axis >= len(shape) or shape[axis] % size:
        return None, f"{key}: shape {tuple(shape)} does not split into {size} along axis {axis}"
    part = shape[axis] // size
    return range_source(reader, key, axis, rank * part, (rank + 1) * part, fp8_block, fp4_block)


def decoded_shape(reader: SafetensorsReader, key: str) -> tuple[int, ...]:
    """Shape of `key` once decoded (packed FP4 holds two values per byte along the last axis)."""
    stored = reader.shape(key)
    return stored if quant_codec(reader, key) != "fp4" else (*stored[:-1], 2 * stored[-1])


def range_source(reader: SafetensorsReader, key: str, axis: int, start: int, stop: int,
                 fp8_block: tuple[int, int], fp4_block: tuple[int, int]) -> tuple[TensorSource | None, str | None]:
    """Entries [start, stop) of `key` along `axis` (decoded coordinates), or a problem. Reads only
    those bytes, and of a quantised weight only the matching rows or columns of its block scales."""
    codec = quant_codec(reader, key)
    full = decoded_shape(reader, key)
    if axis >= len(full) or not 0 <= start <= stop <= full[axis]:
        return None, f"{key}: shape {tuple(full)} has no range [{start}, {stop}) along axis {axis}"
    shape = tuple(stop - start if i == axis else n for i, n in enumerate(full))
    if codec is None:
        return TensorSource(shape, lambda device: reader.get_part(key, axis, start, stop).to(device)), None
    scales, blocks = scale_key(key), fp8_block if codec == "fp8" else fp4_block
    if scales not in reader or reader.shape(scales) != block_grid(full, blocks):
        return None, f"{key}: no block scale {scales} of grid {block_grid(full, blocks)} (block {tuple(blocks)})"
    block = blocks[axis]  # quantised weights are 2-D
    if start % block or (stop % block and stop != full[axis]):
        return None, f"{key}: the range [{start}, {stop}) along axis {axis} cuts its {codec} scale blocks of {block}"
    packed = 2 if codec == "fp4" and axis == len(shape) - 1 else 1  # FP4 packs two values per byte along K

    def read(device):
        weight = reader.get_part(key, axis, start // packed, stop // packed)
        scale = reader.get_part(scales, axis, start // block, -(-stop // block))
        return dequantize(weight.to(device), scale.to(device), fp8_block, fp4_block)

    return TensorSource(shape, read), None
