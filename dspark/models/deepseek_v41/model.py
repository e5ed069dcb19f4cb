"""DeepSeek-V4.1 (Flash) in PyTorch, in paper order, with exact rewindable decode state.

    hashes = Engram n-gram columns of the new tokens            (spec §8.3; depend on ids only)
    X      = embed(ids) copied into hc streams     [N, hc, D];  pre = one-hot(stream 0)   (§3, §4)
    for each layer l:
        X = Engram_l(X)                            (Engram layers, before anything else)
        features[l] = X                            (capture_layers: the drafter's context)
        X, pre = Block_l(X, pre)                   (single-pass mHC around CSA2 attention and MoE)
    logits = head(norm(Σ_k pre_k X_k))             [N, V] fp32; no hc_head

A block's closing mHC post and the next block's attention site run as one op where the streams
between them need not exist on their own (`_materialised_inputs`): 2 mHC ops per layer + 1, plus
one per materialised boundary (Engram layers, the replay split; a DSpark capture point reads the
streams the fused boundary op writes).

One ragged call serves chunked prefill, decode and verify (docs/design.md). CSA2 state shared
across layers (compressed entries, index keys) lives per request in `DecodeStateV41.sources`,
the per-call top-k lists in `SharedSlots`. Parameter names are the official checkpoint keys
(`embed.weight`, `layers.{i}.attn.wq_a.weight`, `layers.{i}.engram.embed.weight`, ...). The DSpark
stages `mtp.0..2` of the release are the drafter's (dspark/draft), not part of this module.

Frozen construction options: `prefill_mode` ("bounded_replay" by default — the decoder runs on
the last `sliding_window` rows of a long prompt chunk, see `replay.py`; "exact" is the
reference), `engram_tables` ("device", "host", or "auto": host when the tables exceed
`ENGRAM_DEVICE_LIMIT_BYTES` and the model is not on the CPU) and `cache_qat` (True: the FP8/FP4
cache formats the model was trained with, spec §11.3; False keeps those vectors unquantised, a
continuous function for exactness tests and ablations, see `qat.py`), and `kernels` (a
`dspark.kernels.KernelConfig`; default `KernelConfig.for_device(device)`: Triton on CUDA, the torch
references elsewhere).

Numerics follow the HF port (spec §12.2) rather than the official kernels: cache QAT included,
no FP8 quantisation of GEMM activations, the LM head in the model dtype, index scores in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.models.deepseek_v4.mhc import collapse
from dspark.kernels import KernelConfig, get_op
from dspark.models.deepseek_v4.model import DeepseekV4Output, resolve_kernels
from dspark.models.deepseek_v4.linear import Linear
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v4.state import LayerCache, RaggedBatch, WindowCache, check_capture, plan_batch
from dspark.models.deepseek_v41 import engram_hash
from dspark.models.deepseek_v41.block import Block, initial_pre
from dspark.models.deepseek_v41.config import DeepseekV41Config
from dspark.models.deepseek_v41.csa2 import SharedSlots
from dspark.models.deepseek_v41.init import random_value
from dspark.models.deepseek_v41.qat import CacheQuant
from dspark.models.deepseek_v41.replay import BOUNDED_REPLAY, PREFILL_MODES, plan_replay, scatter_rows
from dspark.models.deepseek_v41.state import DecodeStateV41, NgramHistory, SourceCache

ENGRAM_PLACEMENTS = ("auto", "device", "host")
# "auto" keeps Engram tables on the accelerator up to this size (the released tables: 2 × ~98 GB).
ENGRAM_DEVICE_LIMIT_BYTES = 4 << 30


@dataclass
class DeepseekV41Output(DeepseekV4Output):
    """Result of one ragged forward call.

    logits   fp32 [N, V]
    hidden   [N, hc, D] final residual streams (before the final collapse)
    features {layer id: [N, hc, D]} input streams of each captured layer, after its Engram
             (id = num_hidden_layers: the final streams)
    valid    bool [N], or None when every row was computed. After bounded replay, rows the decoder
             skipped are False and NaN in `logits`, `hidden` and features of layers after the split.
    """

    valid: torch.Tensor | None = None


class DeepseekV41ForCausalLM(nn.Module):
    """DeepSeek-V4.1 causal LM (text). `dtype` (default fp32) is the weight and activation dtype;
    norms, sinks, router biases and mHC parameters stay fp32 as in the checkpoint. Do not move or
    re-cast the module after construction (host-placed Engram tables and RoPE tables rely on it)."""

    def __init__(self, config: DeepseekV41Config, dtype: torch.dtype | None = None, device=None,
                 prefill_mode: str = BOUNDED_REPLAY, engram_tables: str = "auto", cache_qat: bool = True,
                 kernels: KernelConfig | None = None):
        super().__init__()
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode: {prefill_mode!r} is not one of {PREFILL_MODES}")
        if engram_tables not in ENGRAM_PLACEMENTS:
            raise ValueError(f"engram_tables: {engram_tables!r} is not one of {ENGRAM_PLACEMENTS}")
        c = config
        self.config = config
        self.dtype = dtype or torch.float32
        self._prefill_mode = prefill_mode
        host = engram_tables == "host" or (engram_tables == "auto" and self._engram_too_big(device))
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=self.dtype, device=device)
        if not isinstance(cache_qat, bool):
            raise ValueError(f"cache_qat: expected a bool, got {cache_qat!r}")
        self.cache_qat = cache_qat
        self.kernels = resolve_kernels(kernels, device)
        quant = CacheQuant(cache_qat, get_op(self.kernels, "cache_round"))
        self.layers = nn.ModuleList(Block(c, role, quant, dtype=self.dtype, device=device, host_engram=host,
                                          kernels=self.kernels) for role in c.layer_roles)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, kernels=self.kernels)
        self.head = Linear(c.hidden_size, c.vocab_size, dtype=self.dtype, device=device, kernels=self.kernels)
        self.engram_ids = tuple(c.engram_layer_ids)
        self._init_engram_hashing(device)
        self.has_mtp = False  # the DSpark stages (`mtp.*`) belong to the drafter
        self.requires_grad_(False)  # inference builds no graph; training unfreezes what it trains

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def prefill_mode(self) -> str:
        """Default prefill mode of every call, fixed at construction ("exact" or "bounded_replay")."""
        return self._prefill_mode

    def _engram_too_big(self, device) -> bool:
        c = self.config
        if torch.device(device or "cpu").type == "cpu" or not c.engram_layer_ids:
            return False
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(c.engram_num_embeddings) * c.engram_head_dim * item > ENGRAM_DEVICE_LIMIT_BYTES

    # ---------------------------------------------------------------------------------------
    # Engram hashing (spec §8.1-§8.3)
    # ---------------------------------------------------------------------------------------

    def _init_engram_hashing(self, device) -> None:
        """Non-persistent buffers: the compressed-id table (identity until a tokenizer is bound),
        primes [L, N−1, Hh], column offsets [L, C] and multipliers [L, N]."""
        c = self.config
        primes = engram_hash.table_primes(len(self.engram_ids), c.engram_max_ngram_size, c.engram_n_heads,
                                          c.engram_vocab_size)
        multipliers = engram_hash.hash_multipliers(self.engram_ids, c.engram_max_ngram_size,
                                                   c.engram_compressed_vocab_size)
        orders, heads = c.engram_max_ngram_size - 1, c.engram_n_heads
        buffers = {
            "engram_token_map": torch.arange(c.vocab_size),
            "engram_primes": torch.tensor(primes, dtype=torch.long).reshape(len(primes), orders, heads),
            "engram_offsets": engram_hash.column_offsets(primes).reshape(len(primes), orders * heads),
            "engram_multipliers": multipliers,
        }
        for name, value in buffers.items():
            self.register_buffer(name, value.to(device), persistent=False)

    @torch.no_grad()
    def bind_tokenizer(self, tokenizer) -> DeepseekV41ForCausalLM:
        """Build the Engram compressed-id table from `tokenizer` (spec §8.1) and keep it on the model.

        Without a bound tokenizer the table is the identity (compressed id = token id): fine for
        random-weight models, wrong for trained Engram tables. Token ids the tokenizer does not
        know (vocabulary padding) map to the pad's compressed id. Raises ValueError when the
        tokenizer's compressed vocabulary differs from `engram_compressed_vocab_size` (every
        multiplier depends on it), has more ids than `vocab_size`, or does not know `engram_pad_id`.
        """
        c = self.config
        token_map, n_compressed = engram_hash.build_token_map(tokenizer)
        if n_compressed != c.engram_compressed_vocab_size:
            raise ValueError(f"engram_compressed_vocab_size: {c.engram_compressed_vocab_size} but the tokenizer "
                             f"gives {n_compressed} compressed ids; the Engram hashes would not match the tables")
        if not c.engram_pad_id < len(token_map) <= c.vocab_size:
            raise ValueError(f"tokenizer: {len(token_map)} ids; need more than engram_pad_id={c.engram_pad_id} "
                             f"and at most vocab_size={c.vocab_size}")
        pad = token_map[c.engram_pad_id]
        table = torch.full((c.vocab_size,), pad, dtype=torch.long)
        table[: len(token_map)] = torch.tensor(token_map, dtype=torch.long)
        self.engram_token_map.copy_(table)
        return self

    def _engram_rows(self, batch: RaggedBatch, states: list[DecodeStateV41]):
        """(compressed ids [N] with DEAD for image tokens, {layer: table rows [N, C, hd]}), or (None, {})."""
        if not self.engram_ids:
            return None, {}
        ids = batch.input_ids
        compressed = self.engram_token_map[ids]
        if self.config.image_token_id is not None:
            compressed = compressed.masked_fill(ids == self.config.image_token_id, engram_hash.DEAD)
        pad = int(self.engram_token_map[self.config.engram_pad_id])
        columns = torch.cat([
            engram_hash.ngram_hashes(state.ngram.recent(), compressed[batch.rows(b)], self.engram_multipliers,
                                     self.engram_primes, self.engram_offsets, pad)
            for b, state in enumerate(states)
        ])  # [N, L, C]
        # Issued before layer 0: host-table copies overlap the layers before the Engram layer.
        rows = {layer: self.layers[layer].engram.embed.lookup(columns[:, j], self.device)
                for j, layer in enumerate(self.engram_ids)}
        return compressed, rows

    # ---------------------------------------------------------------------------------------
    # Decode state
    # ---------------------------------------------------------------------------------------

    def new_state(self) -> DecodeStateV41:
        """Empty state for one request."""
        c, device = self.config, self.device
        layers = [LayerCache(WindowCache(c.sliding_window, c.head_dim, self.dtype, device)) for _ in self.layers]
        sources = {i: SourceCache(c.compress_ratios[i], c.head_dim, c.index_head_dim, self.dtype, device)
                   for i in c.kv_source_layer_ids}
        ngram = NgramHistory(c.engram_max_ngram_size - 1, device) if self.engram_ids else None
        return DecodeStateV41(layers, sources, ngram, device)

    # ---------------------------------------------------------------------------------------
    # Forward
    # ---------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, states: list[DecodeStateV41], seq_lens: list[int],
                capture_layers: tuple[int, ...] = (), prefill_mode: str | None = None) -> DeepseekV41Output:
        """Feed request b's `seq_lens[b]` new tokens and append them to `states[b]`.

        input_ids  LongTensor [N], the requests' new tokens concatenated in the order of `states`
        states     one `DecodeStateV41` per request (from `new_state`); positions continue at `.length`
        seq_lens   new tokens per request, each >= 1, summing to N
        capture_layers  layer ids whose input streams (after Engram) to return in `features`
        prefill_mode    None (the model's `prefill_mode`), "exact" or "bounded_replay"
        """
        mode = self._prefill_mode if prefill_mode is None else prefill_mode
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode: {mode!r} is not one of {PREFILL_MODES}")
        capture = self._check_capture(capture_layers)
        batch = plan_batch(input_ids, states, seq_lens, len(self.layers), self.device)
        n, split = batch.input_ids.shape[0], self.config.replay_split_layer
        replay = plan_replay(batch, self.config.sliding_window) if mode == BOUNDED_REPLAY else None
        if split >= len(self.layers):
            replay = None
        compressed, engram_rows = self._engram_rows(batch, states)
        live = None if self.config.image_token_id is None else batch.input_ids != self.config.image_token_id

        x = self.embed(batch.input_ids).unsqueeze(-2).expand(-1, self.config.hc_mult, -1).contiguous()
        pre = initial_pre(n, self.config.hc_mult, self.device)
        slots = [SharedSlots() for _ in states]
        features, rows, step = {}, None, batch  # rows: None = all rows of the call, else the replayed ones
        materialised = self._materialised_inputs(replay)
        site = None  # layer i's attention site when the boundary into it was one fused op
        for i, layer in enumerate(self.layers):
            if layer.engram is not None:
                x = layer.engram(x, _pick(engram_rows[i], rows), _pick(live, rows))
            if i in capture:
                features[i] = x
            sources = [s.sources.get(layer.role.kv_source) for s in states]
            publish = True
            if replay is not None and i == split:
                # The decoder's global KV comes from every row; everything else only from the tail.
                layer.attn.publish(layer.attn_input(x, pre), batch, sources)
                rows, step, publish = replay.rows, replay.batch, False
                x, pre = x[rows], pre[rows]
                for b, state in enumerate(states):
                    if replay.skipped[b]:
                        state.restart_windows(range(split, len(self.layers)), replay.floor(b))
            if site is None:
                site = layer.attn_site(x, pre)
            y, pending = layer.open(x, site, step, [s.layers[i].window for s in states], sources, slots, publish)
            pre = pending.pre
            if i + 1 < len(self.layers) and i + 1 not in materialised:
                x, site = self.layers[i + 1].enter(pending, y)  # post + next pre: one op
            else:
                x, site = layer.close(pending, y), None
        if len(self.layers) in capture:
            features[len(self.layers)] = x
        logits = self.head(self.norm(collapse(x, pre))).float()

        valid = None
        if rows is not None:
            valid = torch.zeros(n, dtype=torch.bool, device=self.device).index_fill_(0, rows, True)
            logits, x = scatter_rows(logits, rows, n), scatter_rows(x, rows, n)
            features = {i: f if f.shape[0] == n else scatter_rows(f, rows, n) for i, f in features.items()}
        for b, state in enumerate(states):
            r = batch.rows(b)
            state.end_step(batch.input_ids[r], None if compressed is None else compressed[r],
                           rewindable=replay is None or not replay.skipped[b])
        return DeepseekV41Output(logits, x, features, valid)

    def _materialised_inputs(self, replay) -> frozenset[int]:
        """Layers whose input streams the loop builds with a standalone post before the layer's
        attention site; at every other boundary the post is fused with the next site (spec §4, the
        deferral of `hc_ffn.post` into the next layer's entry, not across):

        * an Engram layer: Engram adds to the streams before the site may read them;
        * the bounded-replay split (CED boundary, when this call replays): the split publishes the
          attention input of every row, then keeps only the replayed rows.

        A DSpark capture point needs its input streams materialised (spec §4), and the fused boundary
        op writes them (`enter` returns them beside the site), so capture keeps the fusion: the
        target runs the same ops, at the same cost, whether a drafter observes it or not.
        """
        engram = {i for i, layer in enumerate(self.layers) if layer.engram is not None}
        split = {self.config.replay_split_layer} if replay is not None else set()
        return frozenset(engram | split)

    def _check_capture(self, capture_layers) -> frozenset[int]:
        return check_capture(capture_layers, len(self.layers))

    # ---------------------------------------------------------------------------------------
    # Random initialisation for tests and smoke runs
    # ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> DeepseekV41ForCausalLM:
        """Draw every parameter from a seeded CPU generator (device-independent; see `init.py`)."""
        g = torch.Generator().manual_seed(seed)
        for name, tensor in sorted(self.state_dict(keep_vars=True).items()):
            tensor.copy_(random_value(name, tuple(tensor.shape), g))
        return self


def _pick(values: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return values if values is None or rows is None else values[rows]
