"""KV compression for CSA / HCA layers (spec §8.2, §8.4): gated pooling and the lightning indexer.

`Compressor` turns every window of m consecutive tokens into one entry:

    C = x·wkvᵀ, Z = x·wgateᵀ                       per token, [coff·d_c] each
    α = softmax over the window's slots (per channel, fp32) of Z + ape[slot]
    entry_w = RoPE_{w·m}( RMSNorm( Σ_slots α ⊙ C ) )

Without overlap (HCA, m = 128) the slots are the m tokens of window w. With overlap (CSA, m = 4)
each token's projections have two halves [a | b]; entry w pools 2m slots: the "a" halves of window
w−1 and the "b" halves of window w (for w = 0 the "a" slots are empty). Entry w exists once token
(w+1)·m − 1 has been fed; a query at position p may use entries w < (p+1) // m.

`Indexer` (CSA only) runs a second, narrower overlapping compressor whose entries are the index
keys κ_w, and scores query p against them with I(p, w) = Σ_h ω_h · ReLU(q_h · κ_w), keeping the
top-k visible entries per query (ties: the lower entry id).

Shape symbols: N tokens of the call, S tokens of one request, T entries, d_c entry width,
Hi / di indexer heads / head dim, k = index_topk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op
from dspark.models.deepseek_v4.index_batch import padded_index_scores, pads_well
from dspark.models.deepseek_v4.linear import Linear
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v4.rope import Rope
from dspark.models.deepseek_v4.state import CompressorCache, RaggedBatch, copy_rows

# Queries scored against all index keys at once are chunked so that the [S, Hi, T] fp32 score
# tensor stays below this many elements (long prompts would otherwise need tens of GB).
_INDEXER_CHUNK_ELEMENTS = 1 << 26


class Compressor(nn.Module):
    """Gated pooling of m tokens into one entry.

    Parameters (Flash CSA / HCA / indexer): `wkv`, `wgate` [coff·d_c, D] = [1024 / 512 / 256, 4096],
    `ape` [m, coff·d_c] fp32, `norm` [d_c]. The per-request rows and entries live in a
    `CompressorCache`; the module itself is stateless.
    """

    def __init__(self, dim: int, head_dim: int, rate: int, overlap: bool, eps: float, dtype=None, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__()
        # kv [n, slots, d], score [n, slots, d], norm weight [d] -> RMSNorm(Σ softmax(score)·kv) [n, d]
        kernels = KernelConfig() if kernels is None else kernels
        self.pool_op = get_op(kernels, "compressor_pool")
        self.pool_gather_op = get_op(kernels, "compressor_pool_gather")  # the static step's: slots by row
        # The static step pools from its rings only with the fused op (its reference gathers copies anyway).
        self.pools_from_rows = kernels.compressor_pool_gather == "triton"
        # entries [n, d_c], cos/sin [n, rd/2] -> entries rotated to their positions
        self.rope_op = get_op(kernels, "rope")
        # x [N, D], wkv / wgate [W, D], ape [m, W], phase [N] -> (kv [N, W], gate + ape [N, W] fp32)
        self.project_op = get_op(kernels, "compressor_project")
        self.head_dim = head_dim
        self.rate = rate
        self.overlap = overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = Linear(dim, width, dtype=dtype, device=device, kernels=kernels)
        self.wgate = Linear(dim, width, dtype=dtype, device=device, kernels=kernels)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32, device=device))
        self.norm = RMSNorm(head_dim, eps, device=device, kernels=kernels)

    def project(self, x: torch.Tensor, positions: torch.Tensor,
                phase: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token rows for all N tokens: (C [N, coff·d_c] model dtype, Z + ape [N, coff·d_c] fp32).
        `phase` = positions % rate where the caller has it (the static step computes it once per rate)."""
        phase = positions % self.rate if phase is None else phase
        # The gate's linear in the model dtype, + ape promoting to fp32 (the same values as .float()
        # first); at one decode row the fused op is one launch for both weights and the bias.
        return self.project_op(x, self.wkv.weight, self.wgate.weight, self.ape, phase)

    def project_rows(self, x: torch.Tensor, phase: torch.Tensor, kv_rows: torch.Tensor, score_rows: torch.Tensor,
                     rows: torch.Tensor) -> None:
        """`project` of x [N, D] stored at rows [N] (long) of kv_rows [R, coff·d_c] (model dtype) and
        score_rows [R, coff·d_c] fp32: the static step's rings viewed as rows. At one decode row the
        fused op's kernel stores them itself; elsewhere the op copies them after its reference."""
        self.project_op(x, self.wkv.weight, self.wgate.weight, self.ape, phase, kv_out=kv_rows, score_out=score_rows,
                        out_rows=rows)

    def update(self, cache: CompressorCache, kv: torch.Tensor, score: torch.Tensor, rope: Rope) -> None:
        """Append one request's new rows [S, coff·d_c] and emit every entry they complete."""
        first = cache.n_entries
        cache.append_rows(kv, score)
        last = cache.rows_end // self.rate
        if last > first:
            cache.append_entries(self._entries(cache, first, last, rope))

    def update_batch(self, caches: list[CompressorCache], kv: torch.Tensor, score: torch.Tensor, batch: RaggedBatch,
                     rope: Rope) -> None:
        """`update` for every request of a ragged call (kv, score [N, coff·d_c]): rows are appended per
        request, the entries they complete are pooled and rotated in one pass for all requests.

        Pooling, norm and RoPE treat every entry on its own, so this equals per-request `update`.
        """
        firsts = [cache.n_entries for cache in caches]
        reserved = [cache.reserve_rows(n) for cache, n in zip(caches, batch.seq_lens)]
        rows = [batch.rows(b) for b in range(len(caches))]
        for i, values in enumerate((kv, score)):  # one multi-tensor copy per dtype
            copy_rows([pair[i] for pair in reserved], [values[r] for r in rows])
        spans = [(cache, first, cache.rows_end // self.rate) for cache, first in zip(caches, firsts)]
        spans = [span for span in spans if span[2] > span[1]]
        if not spans:
            return
        if self.overlap:
            kv_slots, score_slots = self._overlap_slots_batch(spans)
        else:
            slots = [self._slots(cache, first, last) for cache, first, last in spans]
            kv_slots, score_slots = (torch.cat(part) if len(part) > 1 else part[0] for part in zip(*slots))
        positions = torch.cat([torch.arange(first, last) for _, first, last in spans]) * self.rate
        entries = self.pool(kv_slots, score_slots, positions.to(kv.device, non_blocking=True), rope)
        counts = [last - first for _, first, last in spans]
        copy_rows([cache.reserve_entries(n) for (cache, _, _), n in zip(spans, counts)], list(entries.split(counts)))

    def _entries(self, cache: CompressorCache, first: int, last: int, rope: Rope) -> torch.Tensor:
        """Entries first..last−1 from the cached rows: [last − first, d_c]."""
        kv, score = self._slots(cache, first, last)
        return self.pool(kv, score, torch.arange(first, last, device=kv.device) * self.rate, rope)

    def _slots(self, cache: CompressorCache, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, score) slots [last − first, slots, d_c] of entries first..last−1 from the cached rows."""
        m = self.rate
        kv, score = cache.rows()
        if self.overlap:
            return self._overlap_slots(kv, score, cache.rows_start, first, last)
        lo = first * m - cache.rows_start
        kv = kv[lo : lo + (last - first) * m].unflatten(0, (last - first, m))  # [n, m, d_c]
        score = score[lo : lo + (last - first) * m].unflatten(0, (last - first, m))
        return kv, score

    def pool(self, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, rope: Rope,
             cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Slots [n, slots, d_c] of n entries starting at `positions` [n] -> rotated entries [n, d_c].
        `cos_sin`: `rope.cos_sin(positions)` when the caller has it already (a static step shares it)."""
        # Per-channel softmax over the slots (fp32), weighted sum, RMSNorm: the registry's op.
        normed = self.pool_op(kv, score, self.norm.weight, eps=self.norm.eps, out_dtype=kv.dtype)  # [n, d_c]
        cos, sin = cos_sin if cos_sin is not None else rope.cos_sin(positions)
        return self.rope_op(normed, cos, sin)

    def pool_rows(self, kv_rows: torch.Tensor, score_rows: torch.Tensor, index: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, out_rows: torch.Tensor) -> None:
        """`pool` of entries whose slots are rows of kv_rows / score_rows [R, d_c] (index [n, slots],
        −1 = empty slot), each rotated entry stored at row out_rows[e] of out [R', d_c] (out_rows [n]
        long): the static step pools straight from its rings into its entry buffer, RoPE and the
        store in the pooling launches."""
        self.pool_gather_op(kv_rows, score_rows, index, self.norm.weight, eps=self.norm.eps, out_dtype=out.dtype,
                            cos_sin=cos_sin, out=out, out_rows=out_rows)

    def _overlap_slots_batch(self, spans: list[tuple[CompressorCache, int, int]]):
        """`_overlap_slots` of entries first..last−1 of several caches at once: their row windows are
        concatenated (plus one empty window: value 0, logit −inf, the "a" slots of entry 0) and the
        slots gathered from it with one index -> (kv, score) [Σ n, 2m, d_c]."""
        m, d = self.rate, self.head_dim
        kv_parts, score_parts, prev, cur, n_windows = [], [], [], [], 0
        for cache, first, last in spans:
            kv, score = cache.rows()
            lo = max(first - 1, 0)  # first window read: the "a" halves of entry first's predecessor
            rows = slice(lo * m - cache.rows_start, last * m - cache.rows_start)
            kv_parts.append(kv[rows])
            score_parts.append(score[rows])
            windows = torch.arange(first - lo, last - lo) + n_windows  # window w of each entry
            cur.append(windows)
            before = windows - 1
            if first == 0:
                before[0] = -1  # the empty window appended last
            prev.append(before)
            n_windows += last - lo
        kv_parts.append(kv_parts[0].new_zeros(m, 2 * d))  # window −1 of entry 0 (row −1 of the gather)
        score_parts.append(score_parts[0].new_full((m, 2 * d), float("-inf")))
        index = torch.stack((torch.cat(prev), torch.cat(cur))).to(kv_parts[0].device, non_blocking=True)
        kv_all = torch.cat(kv_parts).unflatten(0, (-1, m))  # [windows + 1, m, 2d]
        score_all = torch.cat(score_parts).unflatten(0, (-1, m))
        kv = torch.cat((kv_all[index[0], :, :d], kv_all[index[1], :, d:]), dim=1)  # [n, 2m, d]
        score = torch.cat((score_all[index[0], :, :d], score_all[index[1], :, d:]), dim=1)
        return kv, score

    def _overlap_slots(self, kv, score, rows_start: int, first: int, last: int):
        """Slots [n, 2m, d_c] of entries first..last−1: "a" halves of window w−1, then "b" halves of w."""
        m, d, n = self.rate, self.head_dim, last - first
        if first == 0:
            # Window −1 does not exist: its slots get value 0 and logit −inf (weight 0). Rows start
            # at position 0 here, since nothing before the first window is ever pruned.
            kv = torch.cat((kv.new_zeros(m, 2 * d), kv[: last * m]))
            score = torch.cat((score.new_full((m, 2 * d), float("-inf")), score[: last * m]))
        else:
            lo = (first - 1) * m - rows_start
            kv, score = kv[lo : lo + (n + 1) * m], score[lo : lo + (n + 1) * m]
        kv = kv.unflatten(0, (n + 1, m))  # [n+1, m, 2d]: window first−1 .. last−1
        score = score.unflatten(0, (n + 1, m))
        kv = torch.cat((kv[:-1, :, :d], kv[1:, :, d:]), dim=1)  # [n, 2m, d]
        score = torch.cat((score[:-1, :, :d], score[1:, :, d:]), dim=1)
        return kv, score


@dataclass(frozen=True)
class IndexerQueries:
    """Indexer inputs for all N tokens of a call, computed densely before the per-request loop."""

    q: torch.Tensor  # [N, Hi, di] rotated queries, model dtype
    weights: torch.Tensor  # [N, Hi] fp32 head weights ω · (Hi · di)^-1/2
    kv: torch.Tensor  # [N, 2·di] compressor rows C
    score: torch.Tensor  # [N, 2·di] compressor rows Z + ape, fp32


def head_weights(indexer, x: torch.Tensor) -> torch.Tensor:
    """x [N, D] -> fp32(weights_proj(x)) / √(Hi·di) [N, Hi] fp32: both score constants folded into the
    head weights (ReLU commutes with a positive scale), through the registry's `linear_scaled`
    (`weights_op`: the cast and the scale in the GEMV's epilogue). `indexer` has weights_proj,
    weights_op, n_heads and head_dim (V4's `Indexer`, V4.1's `csa2.Indexer`)."""
    scale = (indexer.n_heads * indexer.head_dim) ** -0.5
    return indexer.weights_op(x, indexer.weights_proj.weight, scale=scale)


def linear_rope_op(kernels: KernelConfig):
    """The registry's `linear_rope` where both it and `linear` are Triton (the GEMV it extends), else None:
    an indexer then keeps its `wq_b` module's op and the `rope` op."""
    return get_op(kernels, "linear_rope") if kernels.linear_rope == kernels.linear == "triton" else None


def rotated_queries(indexer, q_lora: torch.Tensor, cos, sin) -> torch.Tensor:
    """q_lora [N, q_lora_rank], cos / sin [N, rd/2] -> rope(wq_b(q_lora)) [N, Hi, di] model dtype: one
    `linear_rope` op where the indexer has it (`linear_rope_op`), else its `wq_b` then its `rope_op`.
    `indexer` has wq_b, rope_op, linear_rope_op, n_heads and head_dim (V4's `Indexer`, V4.1's `csa2.Indexer`)."""
    if indexer.linear_rope_op is not None:
        return indexer.linear_rope_op(q_lora, indexer.wq_b.weight, cos, sin, head_dim=indexer.head_dim)
    q = indexer.wq_b(q_lora).unflatten(-1, (indexer.n_heads, indexer.head_dim))
    return indexer.rope_op(q, cos.unsqueeze(-2), sin.unsqueeze(-2))


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: `wq_b` [Hi·di, q_lora], `weights_proj` [Hi, D], `compressor`.

    Scoring and top-k run as the kernel registry's `lightning_indexer` (`kernels`; default the
    torch reference), whose tie rule (equal scores: the lower entry id wins) the model inherits.
    Several requests at once (`select`) are scored together in torch over keys padded to the
    longest request (the registry op takes one key set), with the same formula and tie rule.
    """

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, rate: int,
                 eps: float, dtype=None, device=None, kernels: KernelConfig | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.topk = topk
        self.rate = rate
        # q [S, Hi, di], weights [S, Hi], keys [T, di], visible [S], candidates, topk -> (ids, scores)
        kernels = KernelConfig() if kernels is None else kernels
        self.select_op = get_op(kernels, "lightning_indexer")
        self.topk_op = get_op(kernels, "select_topk")  # the static steps' selection over batched scores
        self.scores_op = get_op(kernels, "index_scores")  # the static steps' scores of every slot at once
        self.rope_op = get_op(kernels, "rope")  # q [N, Hi, di], cos/sin [N, 1, rd/2] -> q rotated
        self.weights_op = get_op(kernels, "linear_scaled")
        self.linear_rope_op = linear_rope_op(kernels)
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim, dtype=dtype, device=device, kernels=kernels)
        self.weights_proj = Linear(dim, n_heads, dtype=dtype, device=device, kernels=kernels)
        self.compressor = Compressor(dim, head_dim, rate, overlap=True, eps=eps, dtype=dtype, device=device,
                                     kernels=kernels)

    def project(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, cos, sin,
                phase: torch.Tensor | None = None) -> IndexerQueries:
        """Dense part for all N tokens: x [N, D] (attention input), q_lora [N, q_lora_rank] (normed c_q);
        `phase` as in `Compressor.project`."""
        q, weights = self.queries(x, q_lora, cos, sin)
        kv, score = self.compressor.project(x, positions, phase)
        return IndexerQueries(q, weights, kv, score)

    def queries(self, x: torch.Tensor, q_lora: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """The query side of `project`: (rotated q [N, Hi, di] model dtype, head weights [N, Hi] fp32)
        (the static step writes the compressor rows itself, `Compressor.project_rows`)."""
        return self.rotated(q_lora, cos, sin), head_weights(self, x)

    def rotated(self, q_lora: torch.Tensor, cos, sin) -> torch.Tensor:
        """The queries alone: q_lora [N, q_lora_rank] -> rotated q [N, Hi, di] model dtype."""
        return rotated_queries(self, q_lora, cos, sin)

    def forward(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """Top-k visible entries per query of one request.

        q [S, Hi, di], weights [S, Hi], keys [T, di], positions [S] -> [S, min(k, T)] long entry ids,
        ascending, −1 where fewer than k entries are visible (future entries w ≥ (p+1)//m never).
        """
        n_keys = keys.shape[0]
        if n_keys == 0:
            return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
        visible = (positions + 1) // self.rate  # entries w < visible are complete for the query
        chunk = max(1, _INDEXER_CHUNK_ELEMENTS // (self.n_heads * n_keys))
        picks = [self.select_op(q[i : i + chunk], weights[i : i + chunk], keys, visible[i : i + chunk], None,
                                topk=self.topk)[0] for i in range(0, q.shape[0], chunk)]
        return torch.cat(picks)

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: list[torch.Tensor],
               batch: RaggedBatch) -> torch.Tensor:
        """Top-k visible entries of every row of a ragged call.

        q [N, Hi, di], weights [N, Hi] (all rows), keys one [T_b, di] per request ->
        [N, min(k, T_max)] long entry ids of the row's own request, ascending, −1 padded.

        One request (or a call dominated by one long request) runs the registry op per request;
        otherwise all requests are scored in one padded pass (`_select_padded`).
        """
        n_keys = [k.shape[0] for k in keys]
        width = min(self.topk, max(n_keys))
        if width == 0:
            return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
        if pads_well(batch):
            return self._select_padded(q, weights, keys, batch, width)
        picks = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
        for b, request_keys in enumerate(keys):
            rows = batch.rows(b)
            ids = self(q[rows], weights[rows], request_keys, batch.positions[rows])
            picks[rows, : ids.shape[1]] = ids
        return picks

    def _select_padded(self, q, weights, keys: list[torch.Tensor], batch: RaggedBatch, width: int) -> torch.Tensor:
        """`select` for many requests in one padded pass (`padded_index_scores`), top-k by the
        registry's `select_topk` (the op's tie rule) over the entries each row can see."""
        visible = (batch.positions + 1) // self.rate  # <= T_b: a request's padding is never visible
        scores = padded_index_scores(q, weights, keys, batch, visible, self.scores_op)  # [N, T_max] fp32
        return self.topk_op(scores, self.topk)  # [N, width]
