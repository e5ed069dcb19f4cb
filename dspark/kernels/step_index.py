"""The `step_index` op's Triton kernel; the op, its segment kinds and its reference are described
in step_index_ref.py (`step_index_ref`, `SegmentTable`).

One launch of (segments, element blocks) programs whatever the model; each program sums the element
counts of the segments before its own to find its offset. No host read: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.registry import require_triton
from dspark.kernels.step_index_ref import (ENTRY_OFFSET, ENTRY_ROW, FIELDS, KEYS, PHASE, POOL, RING, ROW,  # noqa: F401
                                           VISIBLE, SegmentTable, _check_args, step_index_ref)
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


@_jit
def _step_index_kernel(starts_ptr, seg_ptr, out_ptr, n_slots, n_tok, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (g, blk): elements blk·BLOCK .. of segment g. Its offset in `out` is the element count
    of the segments before it (b · ceil(T/m) · width each), summed here from the table."""
    pdl_prologue(PDL)
    g = tl.program_id(0)
    offset = tl.full([], 0, tl.int64)
    for h in range(0, g):
        m_h = tl.load(seg_ptr + h * 8 + 1)
        offset += n_slots * ((n_tok + m_h - 1) // m_h) * tl.load(seg_ptr + h * 8 + 2)
    row = seg_ptr + g * 8
    kind, m, width = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    a, b, c, d, e = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
    groups = (n_tok + m - 1) // m
    count = n_slots * groups * width
    idx = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < count
    j = idx % width
    gi = idx // width  # s · groups + i
    slot = gi // groups
    start = tl.load(starts_ptr + slot, mask=mask, other=0)
    w = start // m + gi % groups  # group w (m = 1: the position p)
    if kind == 0:  # ROW
        value = a + w * m
    elif kind == 1:  # RING
        value = slot * a + w % a
    elif kind == 2:  # KEYS; % only of non-negative values (Triton's % truncates)
        k = w - b + 1 + j
        window = tl.where(k >= 0, slot * a + tl.maximum(k, 0) % a, -1)
        entry = j - b
        causal = tl.where(entry < (w + 1) // c, e + slot * (d + 1) + entry, -1)
        value = tl.where(j < b, window, tl.where(entry < d, causal, -1))
    elif kind == 3:  # PHASE
        value = w % a
    elif kind == 4:  # POOL
        pos = w * m + j - b * m
        rows = slot * a + tl.maximum(pos, 0) % a
        value = tl.where(b != 0, tl.where(pos < 0, -1, 2 * rows + (j >= m).to(tl.int64)), rows)
    elif kind == 5:  # ENTRY_ROW
        complete = (start + n_tok) // m
        value = tl.where(w >= complete, a, w) + slot * (a + 1)
    elif kind == 6:  # ENTRY_OFFSET
        value = a + slot * (b + 1)
    else:  # VISIBLE
        value = (w + 1) // a
    tl.store(out_ptr + offset + idx, value, mask=mask)


_BLOCK = 512  # 4 elements per thread of 4 warps: 78 registers on sm_90 (1024 spilled)


def step_index(starts: torch.Tensor, segments: SegmentTable, *, tokens: int) -> torch.Tensor:
    """Fused `step_index_ref` (same signature): one launch, a row of element blocks per segment."""
    _check_args(starts, segments, tokens)
    require_triton()
    n_slots = starts.shape[0]
    counts = segments.counts(n_slots, tokens)
    out = torch.empty(sum(counts), dtype=torch.long, device=starts.device)
    grid = (len(counts), triton.cdiv(max(counts), _BLOCK))
    pdl = pdl_launch(starts.device, grid[0] * grid[1])
    _step_index_kernel[grid](starts.contiguous(), segments.table, out, n_slots, tokens, BLOCK=_BLOCK, PDL=pdl,
                             launch_pdl=pdl)
    return out
