"""CSA2 attention of one DeepSeek-V4.1 layer (deepseek_v41 spec §5.1).

Every layer, whatever its role (`roles.py`), runs V4's shared-KV MQA core (`LatentAttention`)
without V4's per-head query norm, over its own window:

    c_q = q_norm(x·wq_aᵀ);  q = RoPE(c_q·wq_bᵀ)                [H, d]
    kv  = FP8(RoPE(kv_norm(x·wkvᵀ)))                           [d]   window latent, K = V, QAT (§11.3)
    keys(p) = window latents p−W+1 .. p
            ∪ (ratio > 0) the entries of the layer's KV source picked by the latest index source

then sink softmax, inverse RoPE, grouped `wo_a`, `wo_b` exactly as V4. A KV-source layer first
publishes its new entries and index keys (`publish`, `csa2.py`); an index source then picks
entries (and the candidate source its pool) into the per-request `SharedSlots` the later layers
read. Every ratio > 0 layer uses the compress rope (θ 160000 + YaRN), ratio 0 the main one.

Shape symbols: N rows of the call, S rows of one request, H heads, d head_dim, T entries.
"""

from __future__ import annotations

import torch

from dspark.models.deepseek_v4.attention import LatentAttention, window_index
from dspark.models.deepseek_v4.pool import RequestPool
from dspark.models.deepseek_v4.state import RaggedBatch, WindowCache, copy_rows
from dspark.models.deepseek_v41.csa2 import Compressor, Indexer, SharedSlots
from dspark.models.deepseek_v41.qat import CacheQuant
from dspark.models.deepseek_v41.roles import LayerRole
from dspark.models.deepseek_v41.state import SourceCache


class Attention(LatentAttention):
    """Parameters: `LatentAttention`'s (wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink),
    plus `compressor` (KV sources) and `indexer` (index sources; with `wk`, `k_norm` on KV sources)."""

    def __init__(self, config, role: LayerRole, quant: CacheQuant, dtype=None, device=None, kernels=None):
        super().__init__(config, config.rope_parameters[role.rope], q_head_norm=False, dtype=dtype, device=device,
                         kernels=kernels)
        self.role = role
        self.quant = quant
        self.ratio = role.ratio
        self.compressor = None
        self.indexer = None
        if role.owns_compressor:
            self.compressor = Compressor(config.hidden_size, config.head_dim, role.ratio, config.rms_norm_eps,
                                         dtype=dtype, device=device, kernels=kernels)
        if role.owns_indexer:
            self.indexer = Indexer(config, role, quant, dtype=dtype, device=device, kernels=kernels)

    def publish(self, x: torch.Tensor, batch: RaggedBatch, sources: list[SourceCache]) -> None:
        """KV source (spec §5.2-§5.3): x [N, D] (after attn_norm) -> append each request's new
        entries FP4(RoPE(latent)) and index keys to its `SourceCache`.

        The new latents of all requests are rotated, quantised and keyed in one pass (every step
        is per entry), then appended per request."""
        kv, gate = self.compressor.project(x)
        firsts = [cache.n_entries for cache in sources]
        if gate is None:
            latents, counts = kv, list(batch.seq_lens)  # ratio 1: one entry per token, in row order
        else:
            latents, counts = self.compressor.pool_batch(sources, kv, gate, batch, x.dtype)
        if latents.shape[0] == 0:
            return
        # Entry j stands for position j·ratio; keys come from the latent before its rotation.
        positions = torch.cat([torch.arange(first, first + n) for first, n in zip(firsts, counts)]) * self.ratio
        cos, sin = self.rope.cos_sin(positions.to(x.device, non_blocking=True))
        entries = self.quant.entries(self.rope_op(latents, cos, sin))
        keys = self.indexer.keys(latents, cos, sin)
        reserved = [cache.reserve_entries(n) for cache, n in zip(sources, counts) if n]
        for i, values in enumerate((entries, keys)):
            copy_rows([pair[i] for pair in reserved], [part for part in values.split(counts) if part.shape[0]])

    def publish_per_request(self, x: torch.Tensor, batch: RaggedBatch, sources: list[SourceCache]) -> None:
        """`publish` one request at a time (the reference of the batched pass; `forward_per_request`)."""
        kv, gate = self.compressor.project(x)
        for b, cache in enumerate(sources):
            rows = batch.rows(b)
            first = cache.n_entries
            if gate is None:
                latents = kv[rows]  # ratio 1: one entry per token
            else:
                latents = self.compressor.pool(cache, kv[rows], gate[rows], x.dtype)
            if latents.shape[0] == 0:
                continue
            positions = torch.arange(first, first + latents.shape[0], device=x.device) * self.ratio
            cos, sin = self.rope.cos_sin(positions)
            entries = self.quant.entries(self.rope_op(latents, cos, sin))
            cache.append_entries(entries, self.indexer.keys(latents, cos, sin))

    def forward(self, x: torch.Tensor, batch: RaggedBatch, windows: list[WindowCache],
                sources: list[SourceCache | None], slots: list[SharedSlots], publish: bool = True) -> torch.Tensor:
        """x [N, D] (after attn_norm) -> [N, D]; appends the rows to each request's window.

        windows / sources / slots: per request, this layer's window, its KV source's cache (None
        for ratio 0) and the call's shared slots. `publish=False` skips the KV source's global
        projections when they already ran on these rows' call (bounded replay, spec §6.2).
        All requests share one attention call over one pool (`RequestPool`); an index source still
        picks per request (its candidate pool is per request).
        """
        cos, sin = self.rope.cos_sin(batch.positions)  # [N, rd/2] fp32
        q_lora, q, kv = self.project_qkv(x, cos, sin)
        kv = self.quant.window(kv)  # the window cache is FP8 (QAT over all dims, blocks of 32)
        if self.compressor is not None and publish:
            self.publish(x, batch, sources)
        index_q = self.indexer.queries(x, q_lora, cos, sin) if self.indexer is not None else None
        rows = [batch.rows(b) for b in range(len(windows))]
        copy_rows([w.reserve(n) for w, n in zip(windows, batch.seq_lens)], [kv[r] for r in rows])
        if self.ratio and self.indexer is not None:
            self.indexer.select_batch(*index_q, [source.index_keys() for source in sources], batch, slots)
        entries = [source.entries() for source in sources] if self.ratio else []
        layout = RequestPool(batch, [w.start for w in windows], [w.latents() for w in windows], entries)
        index = layout.window_index(batch.positions, self.window)  # [N, W]
        if self.ratio:  # the latest index source's picks, same rows in the same call
            index = torch.cat((index, layout.entry_rows(_stack_picks([slot.topk for slot in slots]))), dim=-1)
        out = self.attend_op(q, layout.pool(), index, self.attn_sink, self.scale)  # [N, H, d]
        return self.project_out(out, cos, sin)

    def forward_per_request(self, x: torch.Tensor, batch: RaggedBatch, windows: list[WindowCache],
                            sources: list[SourceCache | None], slots: list[SharedSlots],
                            publish: bool = True) -> torch.Tensor:
        """`forward` with one attention call per request (the reference of the batched call)."""
        cos, sin = self.rope.cos_sin(batch.positions)  # [N, rd/2] fp32
        q_lora, q, kv = self.project_qkv(x, cos, sin)
        kv = self.quant.window(kv)
        if self.compressor is not None and publish:
            self.publish_per_request(x, batch, sources)
        index_q = self.indexer.queries(x, q_lora, cos, sin) if self.indexer is not None else None
        out = torch.empty_like(q)
        for b, window in enumerate(windows):
            rows = batch.rows(b)
            out[rows] = self._attend(q[rows], kv[rows], batch.positions[rows], window, sources[b], slots[b],
                                     None if index_q is None else (index_q[0][rows], index_q[1][rows]))
        return self.project_out(out, cos, sin)

    def _attend(self, q, kv, positions, window: WindowCache, source: SourceCache | None, slots: SharedSlots,
                index_q) -> torch.Tensor:
        """One request: q [S, H, d], kv [S, d], positions [S] -> [S, H, d]; appends kv to the window."""
        raw = torch.cat((window.latents(), kv))  # positions window.start .. p_last
        index = window_index(positions, self.window, window.start)  # [S, W]
        window.append(kv)
        pool = raw
        if self.ratio:
            if self.indexer is not None:
                slots.topk = self.indexer.select(*index_q, source.index_keys(), positions, slots)
            picks = slots.topk  # [S, k'] of the latest index source, same rows in the same call
            pool = torch.cat((raw, source.entries()))
            index = torch.cat((index, torch.where(picks >= 0, picks + raw.shape[0], -1)), dim=-1)
        return self.attend_op(q, pool, index, self.attn_sink, self.scale)


def _stack_picks(picks: list[torch.Tensor]) -> torch.Tensor:
    """Per-request entry ids [S_b, k_b] (k_b = min(k, T_b)) -> [N, max k_b], −1 padded."""
    width = max(p.shape[1] for p in picks)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) if p.shape[1] < width else p
                      for p in picks])
