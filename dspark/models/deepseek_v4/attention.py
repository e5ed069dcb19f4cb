"""DeepSeek-V4 attention (spec §7-§9): shared-KV MQA over a sliding window plus compressed entries.

Per token (dense over the N rows of a call):

    c_q = q_norm(x·wq_aᵀ)                 [q_lora]      (also the indexer's input)
    q   = RMS_per_head(c_q·wq_bᵀ), RoPE    [H, d]       rotary part = the last rd dims of each head
    kv  = kv_norm(x·wkvᵀ), RoPE            [d]          one latent, used as key AND value

Per request (the key set differs per request; all requests of a call still run as ONE attention
call, each row's key list pointing into a pool that concatenates every request's keys, `pool.py`):

    keys(p) = window latents of positions p−W+1 .. p  (W = sliding_window, includes p itself)
            ∪ HCA: every entry w < (p+1)//m   |   CSA: the indexer's top-k of those   |   SWA: nothing
    o_h     = Σ_j softmax_j(q_h·k_j / √d  ;  with the per-head sink σ_h in the denominator) · k_j

Then inverse RoPE on the output's rotary dims at the query position (values carried RoPE of their
own positions), the grouped low-rank projection `wo_a` (G groups of H/G heads -> R each) and `wo_b`.

Shape symbols: N rows of the call, S rows of one request, H heads, d head_dim, rd rotary dims,
K keys per query, G o_groups, R o_lora_rank.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op
from dspark.kernels.attention_ref import sparse_attention_ref
from dspark.kernels.norm_rope_ref import norm_then_rope
from dspark.models.deepseek_v4.compressor import Compressor, Indexer
from dspark.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config, RopeParameters
from dspark.models.deepseek_v4.linear import Linear
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v4.pool import RequestPool
from dspark.models.deepseek_v4.rope import Rope
from dspark.models.deepseek_v4.state import CompressorCache, LayerCache, RaggedBatch, WindowCache, copy_rows

# The attention core is the kernel op's torch reference (`dspark.kernels.attention_ref`): the model
# calls the registry's choice, the drafter stages call this name.
sparse_attention = sparse_attention_ref


def window_index(positions: torch.Tensor, window: int, first_row: int) -> torch.Tensor:
    """[S, W] rows of the raw-latent pool for keys p−W+1 .. p; −1 for positions before 0.

    positions [S] absolute query positions; `first_row` the absolute position of pool row 0.
    """
    keys = positions.unsqueeze(-1) - (window - 1) + torch.arange(window, device=positions.device)
    return torch.where(keys >= 0, keys - first_row, -1)


def causal_entry_index(positions: torch.Tensor, n_entries: int, rate: int, offset: int | torch.Tensor) -> torch.Tensor:
    """HCA: [S, T] pool rows (offset + w) of entries w < (p+1)//m, −1 for the rest (spec §8.3).

    `offset` is an int or one per query [S] (a batched pool); T = `n_entries` columns.
    """
    entries = torch.arange(n_entries, device=positions.device)
    visible = entries < ((positions + 1) // rate).unsqueeze(-1)
    offset = offset if isinstance(offset, int) else offset.unsqueeze(-1)
    return torch.where(visible, entries + offset, -1)


class LatentAttention(nn.Module):
    """The shared-KV MQA core common to DeepSeek-V4 and V4.1 (spec §7.1, §7.2, §7.5).

    Parameters (checkpoint names, V4-Flash sizes): wq_a [1024, 4096], q_norm [1024],
    wq_b [32768, 1024], wkv [512, 4096], kv_norm [512], wo_a [8192, 4096] (= G·R × H·d/G),
    wo_b [4096, 8192], attn_sink [64] fp32; `rope` is the layer's RoPE table. Which keys a query
    sees (window, compressed entries) is the subclass's business; `q_head_norm` selects V4's
    per-head unweighted RMS of q (V4.1 dropped it, deepseek_v41 spec §5.1). `kernels` picks the
    attention core (`sparse_attention` of the kernel registry), the inverse RoPE + grouped `wo_a`
    (`grouped_wo_a`), the RoPE of q and kv (`rope`, and `norm_rope`: the per-head q norm / kv_norm
    and the RoPE after it in one op) and every norm (`rms_norm`); default the torch references.
    """

    def __init__(self, config, rope: RopeParameters, q_head_norm: bool, dtype=None, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__()
        c = config
        # q [S, H, d], pool [P, d], index [S, K], sink [H], scale -> [S, H, d]
        kernels = KernelConfig() if kernels is None else kernels
        self.attend_op = get_op(kernels, "sparse_attention")
        # V4's raw q heads [S, H, d], cos/sin [S, rd/2], then attend_op's arguments, eps -> [S, H, d]: the per-head
        # norm and RoPE with the attention (`sparse_attention_qnorm`; the static step asks its `folds`), where it
        # and the ops it joins are Triton
        fused = kernels.sparse_attention_qnorm == kernels.sparse_attention == kernels.norm_rope == "triton"
        self.attend_qnorm_op = get_op(kernels, "sparse_attention_qnorm") if q_head_norm and fused else None
        # out [N, H, d], cos/sin [N, rd/2], wo_a weight [G·R, H·d/G] -> [N, G·R] token-major
        self.wo_a_op = get_op(kernels, "grouped_wo_a")
        # x [..., d], cos/sin broadcastable to [..., rd/2] -> x rotated (a new tensor, x's dtype)
        self.rope_op = get_op(kernels, "rope")
        # x [..., d], weight [d] or None -> RMS-normalised x (V4's per-head q norm: no weight)
        self.norm_op = get_op(kernels, "rms_norm")
        # x [..., d], weight [d] or None, cos/sin as for rope -> rope(rms_norm(x)) [and its rows at out[out_rows]].
        # While the config keeps norm_rope on its reference (CUDA's default until its GPU run) the configured
        # rms_norm and rope ops run in sequence instead: the op's reference would replace fused ones.
        self.norm_rope_op = (get_op(kernels, "norm_rope") if kernels.norm_rope != "ref"
                             else functools.partial(norm_then_rope, self.norm_op, self.rope_op))
        self.n_heads = c.num_attention_heads
        self.head_dim = c.head_dim
        self.window = c.sliding_window
        self.o_groups = c.o_groups
        self.o_lora_rank = c.o_lora_rank
        self.eps = c.rms_norm_eps
        self.q_head_norm = q_head_norm
        self.scale = c.head_dim**-0.5  # no YaRN mscale (spec §7.4)
        linear = dict(dtype=dtype, device=device, kernels=kernels)
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, **linear)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, device=device, kernels=kernels)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, **linear)
        self.wkv = Linear(c.hidden_size, c.head_dim, **linear)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device=device, kernels=kernels)
        group_width = c.num_attention_heads * c.head_dim // c.o_groups
        self.wo_a = nn.Linear(group_width, c.o_groups * c.o_lora_rank, bias=False, dtype=dtype, device=device)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, **linear)
        self.attn_sink = nn.Parameter(torch.zeros(c.num_attention_heads, dtype=torch.float32, device=device))
        self.rope = Rope(rope, c.head_dim, device=device)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_out: torch.Tensor | None = None,
                    kv_rows: torch.Tensor | None = None):
        """x [N, D] (after attn_norm), cos/sin [N, rd/2] -> (c_q [N, q_lora], q [N, H, d], kv [N, d]).

        c_q = q_norm(x·wq_aᵀ) is also the indexer's input; q and kv carry RoPE at their positions.
        kv_out [R, d] (x's dtype, contiguous rows) with kv_rows [N] long: kv row n is also stored at
        row kv_rows[n] of kv_out (the static step's window ring), by the norm + RoPE op itself.
        The q half (`project_q_lora`, `project_q_heads`) and the kv half (`project_kv`) share only x:
        the static step runs them on two streams.
        """
        q_lora = self.project_q_lora(x)
        return q_lora, self.project_q_heads(q_lora, cos, sin), self.project_kv(x, cos, sin, kv_out, kv_rows)

    def project_q_lora(self, x: torch.Tensor) -> torch.Tensor:
        """c_q = q_norm(x·wq_aᵀ) [N, q_lora]: the q half's first step, also the indexer's input."""
        return self.q_norm(self.wq_a(x))

    def project_q_heads(self, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """c_q [N, q_lora] -> q [N, H, d] (wq_b, then the per-head norm and RoPE): the q half's second step."""
        q = self.wq_b(q_lora).unflatten(-1, (self.n_heads, self.head_dim))
        q_cos, q_sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [N, 1, rd/2]: one row for all heads
        if self.q_head_norm:  # per-head unweighted RMS (spec §5), then RoPE
            return self.norm_rope_op(q, None, q_cos, q_sin, eps=self.eps)  # [N, H, d]
        return self.rope_op(q, q_cos, q_sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_out: torch.Tensor | None = None,
                   kv_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`project_qkv`'s kv [N, d] (and its rows stored into kv_out, as there)."""
        return self.norm_rope_op(self.wkv(x), self.kv_norm.weight, cos, sin, eps=self.kv_norm.eps, out=kv_out,
                                 out_rows=kv_rows)

    def project_out(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output [N, H, d] -> [N, D]: inverse RoPE (undoes the values' rotation), the
        block-diagonal `wo_a` (group g: heads g·H/G .., rows g·R .. (g+1)·R−1), `wo_b` (spec §7.5).

        The first two are one op (`grouped_wo_a`), which takes whatever row block of `wo_a` this
        module holds (tensor parallelism keeps G/t groups and their H/t heads).
        """
        return self.wo_b(self.wo_a_op(out, cos, sin, self.wo_a.weight))  # [N, G·R] -> [N, D]


class Attention(LatentAttention):
    """One attention sublayer; `layer_type` picks SWA, CSA or HCA (spec §8).

    Parameters: those of `LatentAttention`, plus `compressor` (CSA, HCA) and `indexer` (CSA).
    """

    def __init__(self, config: DeepseekV4Config, layer_type: str, dtype=None, device=None,
                 kernels: KernelConfig | None = None):
        c = config
        super().__init__(c, c.rope_for(layer_type), q_head_norm=True, dtype=dtype, device=device, kernels=kernels)
        self.layer_type = layer_type
        self.rate = c.compress_rate(layer_type)
        self.compressor = None
        self.indexer = None
        if layer_type != SLIDING:
            self.compressor = Compressor(c.hidden_size, c.head_dim, self.rate, overlap=layer_type == CSA,
                                         eps=c.rms_norm_eps, dtype=dtype, device=device, kernels=kernels)
        if layer_type == CSA:
            self.indexer = Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.index_topk,
                                   self.rate, c.rms_norm_eps, dtype=dtype, device=device, kernels=kernels)

    def new_cache(self, dtype, device) -> LayerCache:
        """Empty per-request state for this layer (see `state.py`)."""
        cache = LayerCache(WindowCache(self.window, self.head_dim, dtype, device))
        if self.compressor is not None:
            cache.compressor = CompressorCache(self.rate, self.compressor.overlap, self.head_dim, dtype, device)
        if self.indexer is not None:
            cache.indexer = CompressorCache(self.rate, True, self.indexer.head_dim, dtype, device)
        return cache

    def forward(self, x: torch.Tensor, batch: RaggedBatch, caches: list[LayerCache]) -> torch.Tensor:
        """x [N, D] (after attn_norm) -> [N, D]; appends the new tokens to each request's cache.

        All requests share one attention call: their window latents and compressed entries are
        concatenated into one pool [P, d] and every row's key list is offset into it (`RequestPool`).
        """
        cos, sin = self.rope.cos_sin(batch.positions)  # [N, rd/2] fp32
        q_lora, q, kv = self.project_qkv(x, cos, sin)
        compressed = index_inputs = None
        if self.compressor is not None:
            compressed = self.compressor.project(x, batch.positions)  # (C, Z + ape) rows for all N tokens
        if self.indexer is not None:
            index_inputs = self.indexer.project(x, q_lora, batch.positions, cos, sin)
        self._update_caches(batch, caches, kv, compressed, index_inputs)

        windows = [cache.window.latents() for cache in caches]  # request b: positions start_b .. p_last
        entries = [cache.compressor.entries() for cache in caches] if self.compressor is not None else []
        layout = RequestPool(batch, [cache.window.start for cache in caches], windows, entries)
        index = layout.window_index(batch.positions, self.window)  # [N, W]
        if self.indexer is not None:  # CSA: the indexer's top-k of each request's complete entries
            keys = [cache.indexer.entries() for cache in caches]
            picks = self.indexer.select(index_inputs.q, index_inputs.weights, keys, batch)  # [N, k'] entry ids
            index = torch.cat((index, layout.entry_rows(picks)), dim=-1)
        elif self.compressor is not None:  # HCA: every complete entry
            index = torch.cat((index, causal_entry_index(batch.positions, layout.max_entries, self.rate,
                                                         layout.entry_offset)), dim=-1)
        out = self.attend_op(q, layout.pool(), index, self.attn_sink, self.scale)  # [N, H, d]
        return self.project_out(out, cos, sin)

    def _update_caches(self, batch: RaggedBatch, caches: list[LayerCache], kv, compressed, index_inputs) -> None:
        """Append every request's window latents and compressor rows (one multi-tensor copy per kind)
        and emit the entries they complete (pooled for all requests at once)."""
        copy_rows([cache.window.reserve(n) for cache, n in zip(caches, batch.seq_lens)],
                  [kv[batch.rows(b)] for b in range(len(caches))])
        if self.compressor is not None:
            self.compressor.update_batch([c.compressor for c in caches], *compressed, batch, self.rope)
        if self.indexer is not None:
            self.indexer.compressor.update_batch([c.indexer for c in caches], index_inputs.kv, index_inputs.score,
                                                 batch, self.rope)

    def forward_per_request(self, x: torch.Tensor, batch: RaggedBatch, caches: list[LayerCache]) -> torch.Tensor:
        """`forward` with one attention call per request (the layout the batched call must reproduce).

        Kept as the reference of the batched path: tests compare the two, the bench times both.
        """
        cos, sin = self.rope.cos_sin(batch.positions)  # [N, rd/2] fp32
        q_lora, q, kv = self.project_qkv(x, cos, sin)
        compressed = index_inputs = None
        if self.compressor is not None:
            compressed = self.compressor.project(x, batch.positions)
        if self.indexer is not None:
            index_inputs = self.indexer.project(x, q_lora, batch.positions, cos, sin)
        out = torch.empty_like(q)
        for b, cache in enumerate(caches):
            rows = batch.rows(b)
            out[rows] = self._attend(q, kv, batch.positions, rows, cache, compressed, index_inputs)
        return self.project_out(out, cos, sin)

    def _attend(self, q, kv, positions, rows: slice, cache: LayerCache, compressed, index_inputs) -> torch.Tensor:
        """Request owning `rows` of q [N, H, d], kv [N, d], positions [N] -> [S, H, d]; updates `cache`."""
        q, kv, positions = q[rows], kv[rows], positions[rows]
        window = cache.window
        raw = torch.cat((window.latents(), kv))  # positions window.start .. p_last
        first_row = window.start
        window.append(kv)
        index = window_index(positions, self.window, first_row)  # [S, W]
        pool = raw
        if self.compressor is not None:
            self.compressor.update(cache.compressor, compressed[0][rows], compressed[1][rows], self.rope)
            entries = cache.compressor.entries()
            pool = torch.cat((raw, entries))
            if self.indexer is None:  # HCA: every complete entry
                picks = causal_entry_index(positions, entries.shape[0], self.rate, raw.shape[0])
            else:  # CSA: the indexer's top-k of the complete entries
                indexer = self.indexer
                indexer.compressor.update(cache.indexer, index_inputs.kv[rows], index_inputs.score[rows], self.rope)
                picks = indexer(index_inputs.q[rows], index_inputs.weights[rows], cache.indexer.entries(), positions)
                picks = torch.where(picks >= 0, picks + raw.shape[0], -1)
            index = torch.cat((index, picks), dim=-1)
        return self.attend_op(q, pool, index, self.attn_sink, self.scale)
