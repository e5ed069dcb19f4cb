"""CSA2's global branch (deepseek_v41 spec §5.2-§5.4): compressor, indexer, candidate pool.

KV-source layers own a `Compressor` that turns their attention input into pre-RoPE latents:

    ratio 2  latent_j = norm( Σ_{t ∈ {2j, 2j+1}} softmax_t(x_t·wgateᵀ) ⊙ (x_t·wkvᵀ) )   fp32 pooling,
             no overlap, no position bias; complete groups only (the odd token waits)
    ratio 1  latent_t = norm(x_t·wkvᵀ)                                                     no gate

Entry j stands for position j·ratio. From each new latent the source derives its index key
k_j = FP4(RoPE(k_norm(latent_j·wkᵀ))) and its entry FP4(RoPE(latent_j)) (spec §5.2-§5.3; the
keys are taken before the latent is rotated).

Index-source layers own an `Indexer`. A query at p scores the visible entries t < (p+1) // ratio

    I[p, t] = Σ_h w_h · ReLU(q_h · k_t),   q = FP4(RoPE(c_q·wq_bᵀ)),  w = weights_proj(x) / √(Hi·di)

and keeps the top `index_topk` (ascending by position, −1 where fewer are visible; equal scores:
the lower entry id wins -- the kernel registry's `lightning_indexer` defines it). The candidate
source publishes a two-level pool (the registry's `indexer_pool`): the best `candidate_topk_blocks`
blocks of `candidate_block_size` entries by block max, the block holding the query's newest entry
pinned in; later index sources score only inside it. Reuse layers take the latest list as it is.

Shape symbols: N tokens of a call, S tokens of one request, T entries, d latent width (head_dim),
Hi / di indexer heads / head dim, k = index_topk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v41.qat import CacheQuant
from dspark.models.deepseek_v4.compressor import head_weights, linear_rope_op, rotated_queries
from dspark.models.deepseek_v4.index_batch import padded_index_scores, pads_well
from dspark.models.deepseek_v4.linear import Linear
from dspark.models.deepseek_v4.state import RaggedBatch, copy_rows
from dspark.models.deepseek_v41.state import SourceCache

# Queries scored at once are chunked so that the [S, Hi, T] fp32 score tensor stays below this
# many elements (a long prompt against a ratio-1 source would otherwise need gigabytes).
_INDEXER_CHUNK_ELEMENTS = 1 << 26


class Compressor(nn.Module):
    """`wkv` [d, D], `wgate` [d, D] (ratio > 1 only), `norm` [d]. Stateless: rows live in a `SourceCache`."""

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float, dtype=None, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__()
        # kv [n, ratio, d], gate [n, ratio, d], norm weight [d] -> norm(Σ softmax(gate)·kv) [n, d]
        kernels = KernelConfig() if kernels is None else kernels
        self.pool_op = get_op(kernels, "compressor_pool")
        # x [N, D], wkv, wgate [d, D] -> (kv, gate) [N, d] fp32 (ratio > 1), optionally into ring rows
        self.project_op = get_op(kernels, "compressor_project_fp32")
        self.ratio = ratio
        # Ratio 1 calls wkv (the registry's `linear`: the decode GEMV where it pays, as V4's projections);
        # ratio > 1 hands both weights to `project_op`.
        self.wkv = Linear(dim, head_dim, dtype=dtype, device=device, kernels=kernels)
        self.wgate = Linear(dim, head_dim, dtype=dtype, device=device, kernels=kernels) if ratio > 1 else None
        self.norm = RMSNorm(head_dim, eps, device=device, kernels=kernels)

    def project(self, x: torch.Tensor, rings: tuple[torch.Tensor, torch.Tensor] | None = None,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dense part for all N tokens, x [N, D]. Ratio > 1: fp32 (kv rows, gate rows) [N, d] each
        (pooled in fp32, the weights promoted from BF16), or with `rings` (the kv and gate rings [R, d]
        fp32) and `rows` [N] long stored at those rows of them (a static step; returns the rings);
        ratio 1: (latents [N, d] in x's dtype, None) — every token is its own entry."""
        if self.wgate is None:
            return self.norm(self.wkv(x)), None
        kv_out, gate_out = rings if rings is not None else (None, None)
        return self.project_op(x, self.wkv.weight, self.wgate.weight, kv_out=kv_out, gate_out=gate_out, out_rows=rows)

    def pool_batch(self, caches: list[SourceCache], kv: torch.Tensor, gate: torch.Tensor, batch: RaggedBatch,
                   dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
        """`pool` for every request of a ragged call (kv, gate [N, d], ratio > 1): rows appended per
        request, the groups they complete pooled in one op call. Returns (latents [Σ n_new, d] in
        request order, n_new per request); pooling is per group, so this equals per-request `pool`."""
        firsts = [cache.n_entries for cache in caches]
        reserved = [cache.reserve_rows(n) for cache, n in zip(caches, batch.seq_lens)]
        rows = [batch.rows(b) for b in range(len(caches))]
        for i, values in enumerate((kv, gate)):
            copy_rows([pair[i] for pair in reserved], [values[r] for r in rows])
        counts, kv_groups, gate_groups = [], [], []
        for cache, first in zip(caches, firsts):
            last = cache.rows_end // self.ratio
            counts.append(last - first)
            if last > first:
                kv_rows, gate_rows = cache.rows()
                lo = first * self.ratio - cache.rows_start
                span = slice(lo, lo + (last - first) * self.ratio)
                kv_groups.append(kv_rows[span].unflatten(0, (last - first, self.ratio)))  # [n_new, ratio, d]
                gate_groups.append(gate_rows[span].unflatten(0, (last - first, self.ratio)))
        if not kv_groups:
            return kv.new_empty((0, kv.shape[-1]), dtype=dtype), counts
        latents = self.pool_op(torch.cat(kv_groups), torch.cat(gate_groups), self.norm.weight, eps=self.norm.eps,
                               out_dtype=dtype)
        return latents, counts

    def pool(self, cache: SourceCache, kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Append one request's rows [S, d] (ratio > 1) and return the latents [n_new, d] of the
        groups they complete, normalised, pre-RoPE, in `dtype`."""
        first = cache.n_entries
        cache.append_rows(kv, gate)
        last = cache.rows_end // self.ratio
        kv_rows, gate_rows = cache.rows()
        lo = first * self.ratio - cache.rows_start
        span = slice(lo, lo + (last - first) * self.ratio)
        kv_rows = kv_rows[span].unflatten(0, (last - first, self.ratio))  # [n_new, ratio, d]
        gate_rows = gate_rows[span].unflatten(0, (last - first, self.ratio))
        return self.pool_op(kv_rows, gate_rows, self.norm.weight, eps=self.norm.eps, out_dtype=dtype)


@dataclass
class SharedSlots:
    """Per-request cross-layer slots of one forward call (spec §5.5): what the latest index source
    chose, read by the layers after it. Entries and index keys live in the `SourceCache`.

    topk        [S, k'] long entry ids (k' = min(k, T)), ascending, −1 = none
    candidates  [S, T] bool, the candidate source's pool (None before it ran or when T = 0)
    """

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


class Indexer(nn.Module):
    """`wq_b` [Hi·di, q_lora], `weights_proj` [Hi, D]; KV sources also own the index-key
    projection `wk` [di, d] and `k_norm` [di]."""

    def __init__(self, config, role, quant: CacheQuant, dtype=None, device=None, kernels: KernelConfig | None = None):
        super().__init__()
        c = config
        self.quant = quant
        # q [S, Hi, di], weights [S, Hi], keys [T, di], visible [S], candidates, topk -> (ids, scores)
        kernels = KernelConfig() if kernels is None else kernels
        self.select_op = get_op(kernels, "lightning_indexer")
        self.topk_op = get_op(kernels, "select_topk")  # the static steps' selection over batched scores
        self.scores_op = get_op(kernels, "index_scores")  # batched scores: static slots, padded requests
        # scores [S, T] fp32, visible [S] -> the candidate pool [S, T] bool (spec §5.4)
        self.pool_op = get_op(kernels, "indexer_pool")
        # Batched scores + the pool's block scores in one kernel (the candidate source's batched passes),
        # only when picked; otherwise (None) `scores_op` then `pool_op` compute the same pool.
        self.pooled_scores_op = (get_op(kernels, "index_scores_pooled")
                                 if role.is_candidate_source and kernels.index_scores_pooled != "ref" else None)
        # x [..., di], cos/sin broadcastable to [..., rd/2] -> x rotated (index keys and queries)
        self.rope_op = get_op(kernels, "rope")
        self.weights_op = get_op(kernels, "linear_scaled")  # see `head_weights`
        self.linear_rope_op = linear_rope_op(kernels)  # see `rotated_queries`
        self.n_heads = c.index_n_heads
        self.head_dim = c.index_head_dim
        self.topk = c.index_topk
        self.ratio = role.ratio
        self.is_candidate_source = role.is_candidate_source
        self.uses_candidates = role.uses_candidates
        self.candidate_blocks = c.candidate_topk_blocks
        self.candidate_block_size = c.candidate_block_size
        linear = dict(dtype=dtype, device=device, kernels=kernels)  # the registry's `linear`, as V4's indexer
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, **linear)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, **linear)
        self.wk = self.k_norm = None
        if role.owns_compressor:
            self.wk = Linear(c.head_dim, c.index_head_dim, **linear)
            self.k_norm = RMSNorm(c.index_head_dim, c.rms_norm_eps, device=device, kernels=kernels)

    def keys(self, latents: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE latents [n, d] with the entries' cos/sin [n, rd/2] -> index keys [n, di]."""
        return self.quant.index(self.rope_op(self.k_norm(self.wk(latents)), cos, sin))

    def queries(self, x: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Dense part for all N tokens -> (q [N, Hi, di] rotated + FP4, weights [N, Hi] fp32)."""
        return self.rotated(q_lora, cos, sin), head_weights(self, x)

    def rotated(self, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The queries alone: q_lora [N, q_lora_rank] -> q [N, Hi, di] rotated + FP4."""
        return self.quant.index(rotated_queries(self, q_lora, cos, sin))

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               slots: SharedSlots) -> torch.Tensor:
        """One request's picks: q [S, Hi, di], weights [S, Hi], keys [T, di], positions [S] ->
        [S, min(k, T)] ascending entry ids, −1 = none. Publishes the candidate pool into `slots`
        (candidate source) or scores inside it (later index sources: the registry op never picks
        outside the pool). Scoring and top-k are the registry's `lightning_indexer`; the candidate source
        with `index_scores_pooled` picked scores with it (the pool's block maxima in the same pass) and
        selects with `select_topk`, the same picks."""
        n_keys = keys.shape[0]
        if n_keys == 0:  # nothing compressed yet: the indexer is not run (spec §5.3)
            return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
        chunk = max(1, _INDEXER_CHUNK_ELEMENTS // (self.n_heads * n_keys))
        visible = (positions + 1) // self.ratio
        pool = slots.candidates if self.uses_candidates and not self.is_candidate_source else None
        picks, pools = [], []
        for i in range(0, q.shape[0], chunk):
            rows = slice(i, i + chunk)
            if self.pooled_scores_op is not None:  # the candidate source, pool block maxima in the score pass
                scores, bscores = self.pooled_scores_op(q[None, rows], weights[None, rows], keys[None],
                                                        visible[None, rows], block=self.candidate_block_size)
                scores, bscores = scores[0], bscores[0]
                ids = self.topk_op(scores, self.topk)  # the lightning indexer's selection and tie rule
            else:
                ids, scores = self.select_op(q[rows], weights[rows], keys, visible[rows],
                                             None if pool is None else pool[rows], topk=self.topk)
                bscores = None
            if self.is_candidate_source:  # its own top-k ignores the pool it publishes (spec §5.3 step 5)
                pools.append(self.pool_op(scores, visible[rows], topk_blocks=self.candidate_blocks,
                                          block=self.candidate_block_size, bscores=bscores))
            picks.append(ids)
        if self.is_candidate_source:
            slots.candidates = torch.cat(pools)
        return torch.cat(picks)

    def select_batch(self, q: torch.Tensor, weights: torch.Tensor, keys: list[torch.Tensor], batch: RaggedBatch,
                     slots: list[SharedSlots]) -> None:
        """`select` for every request of a ragged call: sets slots[b].topk (and, for the candidate
        source, slots[b].candidates) exactly as per-request `select` calls would.

        q [N, Hi, di], weights [N, Hi] (all rows); keys one [T_b, di] per request. Requests with alike
        row counts are scored in one padded pass (`padded_index_scores`, the op reference's formula
        and tie rule), otherwise each runs `select` (the registry op).
        """
        t_max = max(k.shape[0] for k in keys)
        if t_max == 0 or not pads_well(batch):
            for b, request_keys in enumerate(keys):
                rows = batch.rows(b)
                slots[b].topk = self.select(q[rows], weights[rows], request_keys, batch.positions[rows], slots[b])
            return
        visible = (batch.positions + 1) // self.ratio  # [N], <= T_b: padding is never reachable
        bscores = None  # the pool's block scores [N, ceil(T_max / b)] when the scores kernel wrote them
        if self.pooled_scores_op is not None:
            scores, bscores = padded_index_scores(q, weights, keys, batch, visible, self.pooled_scores_op,
                                                  block=self.candidate_block_size)
        else:
            scores = padded_index_scores(q, weights, keys, batch, visible, self.scores_op)  # [N, T_max]
        if self.uses_candidates and not self.is_candidate_source:
            pool = _padded_pool([slot.candidates for slot in slots], batch, t_max, q.device)
            scores = scores.masked_fill(~pool, float("-inf"))
        picks = self.topk_op(scores, self.topk)  # [N, min(k, T_max)]
        pools = None
        if self.is_candidate_source:  # its own top-k ignores the pool it publishes (spec §5.3 step 5)
            pools = self.pool_op(scores, visible, topk_blocks=self.candidate_blocks, block=self.candidate_block_size,
                                 bscores=bscores)  # padding columns are −inf: never kept
        for b, request_keys in enumerate(keys):
            rows, n_keys = batch.rows(b), request_keys.shape[0]
            slots[b].topk = picks[rows, : min(self.topk, n_keys)]
            if pools is not None and n_keys:
                slots[b].candidates = pools[rows, :n_keys]


def _padded_pool(pools: list[torch.Tensor | None], batch: RaggedBatch, width: int, device) -> torch.Tensor:
    """Per-request candidate pools [S_b, T_b] (None: no pool, every entry allowed) -> [N, width] bool,
    False beyond T_b."""
    out = torch.ones(sum(batch.seq_lens), width, dtype=torch.bool, device=device)
    for b, pool in enumerate(pools):
        if pool is not None:
            rows = batch.rows(b)
            out[rows] = torch.nn.functional.pad(pool, (0, width - pool.shape[1]), value=False)
    return out

