"""V4.1's Engram n-gram rows of a static step (deepseek_v41 spec §8.1-§8.3) in one launch.

Op (`engram_rows` is Triton, `engram_rows_ref` is torch, same signature):

* ``engram_rows(input_ids, positions, ring, token_map, multipliers, primes, offsets, *, pad_id,
  image_token_id) -> (columns, live)``: the step's new tokens' compressed ids (`token_map`; DEAD for
  image tokens) go into the n-gram ring at their positions, then every token's look-backs
  t_k = c_{p−k} (k < N; `pad` from the first shift that leaves the sequence or meets DEAD on) are
  hashed into each Engram layer's table columns (`engram_hash.hash_columns`).

Shapes: input_ids, positions [S, T] long (slot s's tokens at positions[s, 0] + 0 .. T − 1); ring
[S', R] long (S' >= S slots, R >= N − 1 + T: a step's rows and its look-backs never share a row),
written in place; token_map [V] long; multipliers [L, N], primes [L, N − 1, Hh], offsets [L, C]
long (C = (N − 1)·Hh); columns [S·T, L, C] long; live [S·T] bool, or None without an image token id.

The reference is the static step's former torch code (about 24 kernels a step: the id map, the ring
write, the look-back gather and its blocking, the hash's multiply / xor / remainder per order). The
kernel runs one program per token: it reads the look-backs inside the step from the step's own ids
and the older ones from the ring (so no program reads a row another writes), then hashes every
column of every layer in int64 as the reference does (no product overflows: the multipliers are
bounded by 2⁶³ / the compressed vocabulary, and every operand is non-negative, so `%` is torch's
remainder). Integer arithmetic: the same values. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue
from dspark.models.deepseek_v41.engram_hash import DEAD, hash_columns


def _check_args(input_ids, positions, ring, token_map, multipliers, primes, offsets) -> None:
    if input_ids.dim() != 2 or positions.shape != input_ids.shape:
        raise ValueError(f"input_ids and positions must be [S, T] alike, got {tuple(input_ids.shape)} and "
                         f"{tuple(positions.shape)}")
    if multipliers.dim() != 2 or multipliers.shape[0] == 0 or multipliers.shape[1] < 2:
        raise ValueError(f"multipliers must be [L >= 1, N >= 2], got {tuple(multipliers.shape)}")
    n_layers, n_shift = multipliers.shape
    if primes.shape != (n_layers, n_shift - 1, primes.shape[-1]) or offsets.shape != (n_layers, primes[0].numel()):
        raise ValueError(f"primes must be [L, N - 1, Hh] and offsets [L, C] for multipliers [L={n_layers}, "
                         f"N={n_shift}], got {tuple(primes.shape)} and {tuple(offsets.shape)}")
    rows_needed = n_shift - 1 + input_ids.shape[1]
    if ring.dim() != 2 or not ring.is_contiguous() or ring.shape[0] < input_ids.shape[0] or ring.shape[1] < rows_needed:
        raise ValueError(f"ring must be a contiguous [S' >= {input_ids.shape[0]}, R >= N - 1 + T = {rows_needed}], "
                         f"got {tuple(ring.shape)}")
    for name, t in (("input_ids", input_ids), ("positions", positions), ("ring", ring), ("token_map", token_map),
                    ("multipliers", multipliers), ("primes", primes), ("offsets", offsets)):
        if t.dtype != torch.long:
            raise ValueError(f"{name} must be int64, got {t.dtype}")


def engram_rows_ref(input_ids: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor, token_map: torch.Tensor,
                    multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, *, pad_id: int,
                    image_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's Engram table columns (module docstring), torch ops; writes the ring."""
    _check_args(input_ids, positions, ring, token_map, multipliers, primes, offsets)
    compressed = token_map[input_ids]  # [S, T]
    live = None
    if image_token_id is not None:
        live = input_ids != image_token_id
        compressed = compressed.masked_fill(~live, DEAD)
        live = live.reshape(-1)
    size = ring.shape[1]
    base = torch.arange(0, input_ids.shape[0] * size, size, device=ring.device).unsqueeze(-1)  # [S, 1] slot rows
    flat = ring.view(-1)
    flat.index_copy_(0, (positions.remainder(size) + base).reshape(-1), compressed.reshape(-1))
    back = positions.unsqueeze(-1) - torch.arange(multipliers.shape[1], device=positions.device)  # [S, T, N]
    seen = flat[back.clamp(min=0).remainder(size) + base.unsqueeze(-1)]  # shift k = the id at p − k
    # A shift that leaves the sequence or meets DEAD blocks itself and every longer one.
    blocked = ((back < 0) | (seen == DEAD)).cumsum(dim=-1) > 0
    tokens = torch.where(blocked, token_map[pad_id], seen)
    return hash_columns(tokens, multipliers, primes, offsets).flatten(0, 1), live


@_jit
def _engram_rows_kernel(ids_ptr, pos_ptr, ring_ptr, map_ptr, mult_ptr, primes_ptr, offsets_ptr, cols_ptr, live_ptr,
                        n_tok, ring_size, pad_id, image_id, N_SHIFT: tl.constexpr, N_HEADS: tl.constexpr,
                        N_COLS: tl.constexpr, N_ALL: tl.constexpr, BLOCK: tl.constexpr, HAS_IMAGE: tl.constexpr,
                        PDL: tl.constexpr):
    """One program per token i (slot i // T): its ring row, its N look-backs, then its L·C columns."""
    pdl_prologue(PDL)
    i = tl.program_id(0)
    row0 = (i // n_tok).to(tl.int64) * ring_size
    p = tl.load(pos_ptr + i)
    start = p - i % n_tok
    token = tl.load(ids_ptr + i)
    own = tl.load(map_ptr + token)
    if HAS_IMAGE:
        own = tl.where(token == image_id, -1, own)  # DEAD
        tl.store(live_ptr + i, token != image_id)
    tl.store(ring_ptr + row0 + p % ring_size, own)
    pad = tl.load(map_ptr + pad_id)
    j = tl.arange(0, BLOCK)  # column j of the token's [L, C] block
    mask = j < N_ALL
    layer = j // N_COLS
    order = (j % N_COLS) // N_HEADS + 2  # column j hashes the n-gram of shifts 0 .. order − 1
    rolling = tl.zeros([BLOCK], dtype=tl.int64)
    blocked = p < 0
    for k in tl.static_range(N_SHIFT):
        q = p - k
        inside = q >= start  # a token of this step: its id, not its ring row (another program writes that)
        earlier = tl.load(ring_ptr + row0 + tl.maximum(q, 0) % ring_size, mask=(q >= 0) & (q < start), other=0)
        mine = tl.load(ids_ptr + i - k, mask=inside, other=0)
        seen = tl.load(map_ptr + mine, mask=inside, other=0)
        if HAS_IMAGE:
            seen = tl.where(mine == image_id, -1, seen)
        seen = tl.where(inside, seen, earlier)
        blocked = blocked | (q < 0) | (seen == -1)  # this shift and every longer one
        mult = tl.load(mult_ptr + layer * N_SHIFT + k, mask=mask, other=0)
        rolling = tl.where(k < order, rolling ^ (tl.where(blocked, pad, seen) * mult), rolling)
    prime = tl.load(primes_ptr + j, mask=mask, other=1)
    offset = tl.load(offsets_ptr + j, mask=mask, other=0)
    tl.store(cols_ptr + i.to(tl.int64) * N_ALL + j, rolling % prime + offset, mask=mask)


def engram_rows(input_ids: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor, token_map: torch.Tensor,
                multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, *, pad_id: int,
                image_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`engram_rows_ref` in one launch (same signature; module docstring)."""
    require_triton()
    _check_args(input_ids, positions, ring, token_map, multipliers, primes, offsets)
    (n_slots, n_tok), (n_layers, n_shift), n_cols = input_ids.shape, multipliers.shape, offsets.shape[1]
    n, device = n_slots * n_tok, input_ids.device
    columns = torch.empty(n, n_layers, n_cols, dtype=torch.long, device=device)
    live = torch.empty(n, dtype=torch.bool, device=device) if image_token_id is not None else None
    if n:
        pdl = pdl_launch(device, n)
        _engram_rows_kernel[(n,)](
            input_ids.contiguous(), positions.contiguous(), ring, token_map.contiguous(), multipliers.contiguous(),
            primes.contiguous(), offsets.contiguous(), columns, columns if live is None else live, n_tok,
            ring.shape[1], int(pad_id), 0 if image_token_id is None else int(image_token_id), N_SHIFT=n_shift,
            N_HEADS=primes.shape[-1], N_COLS=n_cols, N_ALL=n_layers * n_cols,
            BLOCK=triton.next_power_of_2(n_layers * n_cols), HAS_IMAGE=image_token_id is not None, PDL=pdl,
            launch_pdl=pdl, num_warps=1)
    return columns, live
