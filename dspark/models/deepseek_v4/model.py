"""DeepSeek-V4 (Flash / Pro) in PyTorch, in paper order, with exact rewindable decode state.

    e  = embed(ids)                                    [N, D]
    X  = e copied into n_hc streams                    [N, n_hc, D]      (mHC residual, spec §6)
    for each layer:                                                      (spec §4)
        u = mHC_pre(X; hc_attn);  X = mHC_post(attn(attn_norm(u)), X)    (attention: spec §7-§9)
        v = mHC_pre(X; hc_ffn);   X = mHC_post(ffn(ffn_norm(v), ids), X) (MoE: spec §11)
    logits = head(norm(hc_head(X)))                    [N, V] fp32

Every mHC post is followed by the next site's pre, so they run as one op (`mhc_post_pre`, spec
§6.5), inside a block and across block boundaries: 2 mHC ops per layer + 1 (`Block`). Every pre is
followed by its sublayer's norm, which folds into the site op where `mhc_pre_norm` /
`mhc_post_pre_norm` are on (`dspark.kernels.norm_folded_op`); the output collapse and `norm` are
one op where `hc_head_norm` is on (`dspark.kernels.head_norm_op`).

One ragged call serves chunked prefill, one-token decode and multi-token verify (docs/design.md):
the N rows are the concatenated new tokens of several requests; dense parts (projections, MoE, mHC)
run over all N rows at once, and so does attention: one sparse-attention call per layer over a pool
that concatenates every request's window and entries (`pool.py`); only the appends to each
request's state are per request (one multi-tensor copy per kind). Parameter names are
the official checkpoint keys (`embed.weight`, `layers.{i}.attn.wq_a.weight`, ..., `mtp.0.*`).

The MTP block (`mtp.0`, spec §12) is a sliding-window, score-routed layer with its own input
projections and HC head, sharing the embedding and the LM head; `forward_mtp` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op, head_norm_op, norm_folded_op
from dspark.models.deepseek_v4.attention import Attention
from dspark.models.deepseek_v4.config import HASH_MOE, MOE, SLIDING, DeepseekV4Config
from dspark.models.deepseek_v4.moe import MoE
from dspark.models.deepseek_v4.linear import Linear
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v4.state import DecodeState, LayerCache, RaggedBatch, check_capture, plan_batch


@dataclass
class DeepseekV4Output:
    """Result of one ragged forward call.

    logits   fp32 [N, V]
    hidden   [N, n_hc, D] final residual streams before the HC head (the MTP block's input)
    features {layer id: [N, n_hc, D]} input streams of each captured layer (id = num_hidden_layers:
             the final streams)
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    features: dict[int, torch.Tensor] = field(default_factory=dict)


def resolve_kernels(kernels: KernelConfig | None, device) -> KernelConfig:
    """The model's kernel choice: `kernels` as given, or the default for `device` when None."""
    if kernels is None:
        return KernelConfig.for_device(torch.device(device or "cpu"))
    if not isinstance(kernels, KernelConfig):
        raise ValueError(f"kernels must be a dspark.kernels.KernelConfig (or None), got {kernels!r}")
    return kernels


def _hc_params(n_mix: int, width: int, n_scales: int, device) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """fp32 (fn [n_mix, width], base [n_mix], scale [n_scales]) of one mHC site; neutral init."""
    fn = nn.Parameter(torch.zeros(n_mix, width, dtype=torch.float32, device=device))
    base = nn.Parameter(torch.zeros(n_mix, dtype=torch.float32, device=device))
    scale = nn.Parameter(torch.ones(n_scales, dtype=torch.float32, device=device))
    return fn, base, scale


class Site(NamedTuple):
    """The mixes of an mHC site whose sublayer has not run yet (the output of a pre and its norm).

    post [N, n_hc] fp32, comb [N, n_hc, n_hc] fp32, h [N, D] the sublayer input: the collapse u
    after the sublayer's RMSNorm (attn_norm / ffn_norm).
    """

    post: torch.Tensor
    comb: torch.Tensor
    h: torch.Tensor


class PendingPost(NamedTuple):
    """An mHC post not yet applied: X' = post ⊗ f + combᵀ·Y, with Y the streams it goes with.

    f [N, D] the sublayer output, post [N, n_hc] fp32, comb [N, n_hc, n_hc] fp32.
    """

    f: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


class Block(nn.Module):
    """One layer: [mHC-pre, attn_norm, attention, mHC-post] then [mHC-pre, ffn_norm, MoE, mHC-post].

    The mHC parameters sit on the block under their checkpoint names `hc_attn_{fn,base,scale}` /
    `hc_ffn_{fn,base,scale}` (fp32; fn [24, 4·D] for n_hc = 4).

    `kernels` (default: torch references) picks every implementation. The mHC sites run as the
    registry's ops: `mhc_pre` (attention site), `mhc_post_pre` (the attention's post fused with the
    MoE's pre), `mhc_post` (the MoE's post); each pre's sublayer norm (attn_norm / ffn_norm) runs
    folded into it (`mhc_pre_norm` / `mhc_post_pre_norm`) where those ops are on, after it otherwise.
    `forward` runs the block closed (3 mHC ops); the model instead opens it (`open`: everything up
    to the MoE's output, the post left pending) and applies the pending post with the next block's
    `enter` (`mhc_post_pre` again): 2 ops per block + 1.
    """

    def __init__(self, config: DeepseekV4Config, layer_type: str, mlp_type: str, dtype=None, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__()
        c = config
        kernels = KernelConfig() if kernels is None else kernels
        self.n_hc = c.hc_mult
        self.sinkhorn_iters = c.hc_sinkhorn_iters
        self.hc_eps = c.hc_eps
        self.norm_eps = c.rms_norm_eps
        self.attn = Attention(c, layer_type, dtype=dtype, device=device, kernels=kernels)
        self.ffn = MoE(c, hashed=mlp_type == HASH_MOE, dtype=dtype, device=device, kernels=kernels)
        # The references are `hc_pre`/`hc_post` of mhc.py then the norm, op for op: "ref" changes no bit.
        self.pre_op = norm_folded_op(kernels, "mhc_pre_norm")
        self.post_pre_op = norm_folded_op(kernels, "mhc_post_pre_norm")
        self.post_op = get_op(kernels, "mhc_post")
        self.mhc_eps = dict(rms_eps=self.norm_eps, hc_eps=self.hc_eps, sinkhorn_iters=self.sinkhorn_iters)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, kernels=kernels)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, kernels=kernels)
        n_mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size  # [pre | post | comb] mixes
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _hc_params(n_mix, width, 3, device)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _hc_params(n_mix, width, 3, device)

    def forward(self, x: torch.Tensor, batch: RaggedBatch, caches: list[LayerCache]) -> torch.Tensor:
        """The block closed: x [N, n_hc, D] -> [N, n_hc, D] (pre, attention, post+pre, MoE, post)."""
        y, pending = self.open(x, self.attn_site(x), batch, caches)
        return self.close(pending, y)

    def attn_site(self, x: torch.Tensor, mixes_on=None) -> Site:
        """The attention site's pre and attn_norm on the block's input streams x [N, n_hc, D].
        `mixes_on`: where the site op launches its post and comb (`mhc_norm._launch_norm_epilogue`,
        `mhc._launch_epilogue`; the static step's side stream, joined before the next site reads them)."""
        return Site(*self.pre_op(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm.weight,
                                 norm_eps=self.attn_norm.eps, mixes_on=mixes_on, **self.mhc_eps))

    def enter(self, pending: PendingPost, y: torch.Tensor, mixes_on=None) -> tuple[torch.Tensor, Site]:
        """The previous block's pending post on its streams y [N, n_hc, D], fused with this block's
        attention-site pre (and attn_norm): one op. Returns (this block's input streams x [N, n_hc, D],
        its Site). `mixes_on` as `attn_site`'s."""
        x, post, comb, h = self.post_pre_op(pending.f, y, pending.post, pending.comb, self.hc_attn_fn,
                                            self.hc_attn_base, self.hc_attn_scale, self.attn_norm.weight,
                                            norm_eps=self.attn_norm.eps, mixes_on=mixes_on, **self.mhc_eps)
        return x, Site(post, comb, h)

    def open(self, x: torch.Tensor, site: Site, batch: RaggedBatch,
             caches: list[LayerCache]) -> tuple[torch.Tensor, PendingPost]:
        """Attention, its post fused with the MoE site's pre, MoE; the MoE's post left pending.

        x [N, n_hc, D] the block's input streams, `site` their attention-site mixes. Returns
        (streams y [N, n_hc, D] after the attention's post, the MoE's PendingPost on y).
        """
        return self.ffn_after(self.attn(site.h, batch, caches), x, site, batch.input_ids)

    def ffn_after(self, a: torch.Tensor, x: torch.Tensor, site: Site, input_ids: torch.Tensor,
                  mixes_on=None) -> tuple[torch.Tensor, PendingPost]:
        """Everything of `open` after the attention: its post fused with the MoE site's pre, then MoE.

        a [N, D] the attention output, x [N, n_hc, D] the block's input streams, `site` their
        attention-site mixes, input_ids [N] (hash routing). Split out so that another attention
        driver (the static decode step, `static_step.py`) runs the same block. `mixes_on` as
        `attn_site`'s (the MoE site's mixes).
        """
        y, post, comb, h = self.post_pre_op(a, x, site.post, site.comb, self.hc_ffn_fn, self.hc_ffn_base,
                                            self.hc_ffn_scale, self.ffn_norm.weight, norm_eps=self.ffn_norm.eps,
                                            mixes_on=mixes_on, **self.mhc_eps)
        return y, PendingPost(self.ffn(h, input_ids), post, comb)

    def close(self, pending: PendingPost, y: torch.Tensor) -> torch.Tensor:
        """Apply the pending post alone (no next site to fuse with): y [N, n_hc, D] -> [N, n_hc, D]."""
        return self.post_op(pending.f, y, pending.post, pending.comb)


class MTPBlock(Block):
    """The next-token-prediction block `mtp.{k}` (spec §12): a sliding-window, score-routed layer.

    Input for draft position t: the main model's final streams X_t [n_hc, D] and the embedding of
    token t+1: z = e_proj(enorm(embed(id))) (same for every stream) + h_proj(hnorm(X_t)) (per stream).
    Output collapse: its own `hc_head_*`, then `norm`, then the shared LM head.
    """

    def __init__(self, config: DeepseekV4Config, dtype=None, device=None, kernels: KernelConfig | None = None):
        super().__init__(config, SLIDING, MOE, dtype=dtype, device=device, kernels=kernels)
        c = config
        linear = dict(bias=False, dtype=dtype, device=device)
        self.e_proj = nn.Linear(c.hidden_size, c.hidden_size, **linear)
        self.h_proj = nn.Linear(c.hidden_size, c.hidden_size, **linear)
        norm = dict(device=device, kernels=kernels)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **norm)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **norm)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **norm)
        head = _hc_params(c.hc_mult, c.hc_mult * c.hidden_size, 1, device)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = head
        self.head_norm_op = head_norm_op(KernelConfig() if kernels is None else kernels)  # hc_head, then norm

    def mix_inputs(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embedded [N, D] (embedding of the next token), hidden [N, n_hc, D] -> block input [N, n_hc, D]."""
        return self.e_proj(self.enorm(embedded)).unsqueeze(-2) + self.h_proj(self.hnorm(hidden))

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        """[N, n_hc, D] -> [N, D], normalised, ready for the shared head."""
        return self.head_norm_op(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm.weight,
                                 rms_eps=self.norm_eps, hc_eps=self.hc_eps, norm_eps=self.norm.eps)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 causal LM with the MTP block(s) of the checkpoint.

    Build with `DeepseekV4ForCausalLM(config, dtype, device)`; `dtype` (default fp32) is the
    activation and weight dtype of the linears and embeddings; norms, sinks, `ape`, router bias and
    all mHC parameters stay fp32 as in the checkpoint. Do not re-cast the module afterwards.
    `kernels` picks the implementation of each fused op (`dspark.kernels.KernelConfig`); default
    `KernelConfig.for_device(device)`: the Triton kernels on CUDA, the torch references elsewhere.
    """

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype | None = None, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__()
        c = config
        self.config = config
        self.kernels = resolve_kernels(kernels, device)
        self.dtype = dtype or torch.float32
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=self.dtype, device=device)
        self.layers = nn.ModuleList(
            Block(c, layer_type, mlp_type, dtype=self.dtype, device=device, kernels=self.kernels)
            for layer_type, mlp_type in zip(c.layer_types, c.mlp_layer_types)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, kernels=self.kernels)
        self.head = Linear(c.hidden_size, c.vocab_size, dtype=self.dtype, device=device, kernels=self.kernels)
        head = _hc_params(c.hc_mult, c.hc_mult * c.hidden_size, 1, device)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = head
        self.head_norm_op = head_norm_op(self.kernels)  # hc_head, then norm (at "ref" exactly the two)
        self.mtp = nn.ModuleList(
            MTPBlock(c, dtype=self.dtype, device=device, kernels=self.kernels) for _ in range(c.num_nextn_predict_layers)
        )
        # Frozen by default: inference builds no autograd graph. Training unfreezes what it trains.
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # ---------------------------------------------------------------------------------------
    # Decode state
    # ---------------------------------------------------------------------------------------

    def new_state(self) -> DecodeState:
        """Empty state for one request of the main model."""
        return DecodeState([layer.attn.new_cache(self.dtype, self.device) for layer in self.layers], self.device)

    def new_mtp_state(self, depth: int = 0) -> DecodeState:
        """Empty state (one sliding-window layer) for one request of MTP block `depth`."""
        self._check_mtp_depth(depth)
        return DecodeState([self.mtp[depth].attn.new_cache(self.dtype, self.device)], self.device)

    # ---------------------------------------------------------------------------------------
    # Forward
    # ---------------------------------------------------------------------------------------

    # No no_grad here: `load_model`/`init_model` freeze the weights (requires_grad False), so inference
    # builds no graph, and training code can unfreeze what it trains and differentiate through this.
    def forward(
        self,
        input_ids: torch.Tensor,
        states: list[DecodeState],
        seq_lens: list[int],
        capture_layers: tuple[int, ...] = (),
    ) -> DeepseekV4Output:
        """Feed request b's `seq_lens[b]` new tokens and append them to `states[b]`.

        input_ids  LongTensor [N], the requests' new tokens concatenated in the order of `states`
        states     one DecodeState per request (from `new_state`); positions continue at `.length`
        seq_lens   new tokens per request, each >= 1, summing to N
        capture_layers  layer ids whose input streams to return in `features`

        Returns logits fp32 [N, V] for every row, the final streams [N, n_hc, D] and the features.
        """
        capture = self._check_capture(capture_layers)
        batch = self._plan(input_ids, states, seq_lens, len(self.layers))
        x = self.embed(batch.input_ids)
        x = x.unsqueeze(-2).expand(-1, self.config.hc_mult, -1).contiguous()  # [N, n_hc, D]
        features = {}
        # The loop, not the block, owns each block boundary: the boundary op needs the previous
        # block's pending post and the next block's attention-site parameters, so one fused
        # `mhc_post_pre` (`enter`) replaces a post and a pre. Its output is the next block's input
        # streams, materialised anyway, so captured features and the final streams are unchanged.
        site = self.layers[0].attn_site(x)
        for i, layer in enumerate(self.layers):
            if i in capture:
                features[i] = x
            y, pending = layer.open(x, site, batch, [state.layers[i] for state in states])
            if i + 1 < len(self.layers):
                x, site = self.layers[i + 1].enter(pending, y)
            else:
                x = layer.close(pending, y)
        if len(self.layers) in capture:
            features[len(self.layers)] = x
        self._commit(states, batch)
        return DeepseekV4Output(self._logits(self.collapse(x)), x, features)

    def forward_mtp(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        states: list[DecodeState],
        seq_lens: list[int],
        depth: int = 0,
    ) -> DeepseekV4Output:
        """Run MTP block `depth` (spec §12) as a ragged call, like `forward`.

        Row r pairs the streams that predicted a token, `hidden[r]` [n_hc, D] (main model:
        `DeepseekV4Output.hidden` at position t), with that token's id `input_ids[r]` (t+1); it
        sits at position t in its MTP state (`new_mtp_state`), which must advance in step with
        the main model. Returns the draft logits [N, V] and the block's output streams
        [N, n_hc, D] (the input of a following MTP block).
        """
        self._check_mtp_depth(depth)
        if hidden.shape != (input_ids.shape[0], self.config.hc_mult, self.config.hidden_size):
            raise ValueError(f"forward_mtp: hidden has shape {tuple(hidden.shape)}, expected "
                             f"[{input_ids.shape[0]}, {self.config.hc_mult}, {self.config.hidden_size}]")
        mtp = self.mtp[depth]
        batch = self._plan(input_ids, states, seq_lens, 1)
        x = mtp.mix_inputs(self.embed(batch.input_ids), hidden.to(self.dtype))
        x = mtp(x, batch, [state.layers[0] for state in states])
        self._commit(states, batch)
        return DeepseekV4Output(self._logits(mtp.collapse(x)), x)

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        """Output collapse `hc_head` (spec §6.4) then `norm`: final streams [N, n_hc, D] -> [N, D], the
        LM head's input (one op where `hc_head_norm` is on)."""
        return self.head_norm_op(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm.weight,
                                 rms_eps=self.config.rms_norm_eps, hc_eps=self.config.hc_eps, norm_eps=self.norm.eps)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head in the model dtype, returned as fp32 [N, V]."""
        return self.head(h).float()

    def _plan(self, input_ids: torch.Tensor, states: list[DecodeState], seq_lens: list[int],
              n_layers: int) -> RaggedBatch:
        """Validate one ragged call, start a step on every state, build the batch metadata."""
        return plan_batch(input_ids, states, seq_lens, n_layers, self.device)

    @staticmethod
    def _commit(states: list[DecodeState], batch: RaggedBatch) -> None:
        for b, state in enumerate(states):
            state.end_step(batch.input_ids[batch.rows(b)])

    def _check_capture(self, capture_layers) -> frozenset[int]:
        return check_capture(capture_layers, len(self.layers))

    def _check_mtp_depth(self, depth: int) -> None:
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"MTP depth {depth} outside [0, {len(self.mtp)}) (num_nextn_predict_layers)")

    # ---------------------------------------------------------------------------------------
    # Random initialisation for tests and smoke runs
    # ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> DeepseekV4ForCausalLM:
        """Draw every parameter and buffer from a seeded CPU generator (device-independent).

        Values are chosen so that a test notices any wiring mistake (N(mean, std)): linear weights
        and mHC `fn` N(0, 1/√fan_in) so activations stay O(1), embedding N(0, 1), norm weights
        1 + N(0, 0.1), attention sinks, `ape` and mHC `base` N(0, 0.5), mHC `scale` U(0.5, 1.5),
        router bias N(0, 0.1), and each `tid2eid` row K distinct random experts.
        """
        g = torch.Generator().manual_seed(seed)
        for name, tensor in sorted(self.state_dict(keep_vars=True).items()):
            tensor.copy_(_random_value(name, tuple(tensor.shape), g, self.config.n_routed_experts))
        return self


def _random_value(name: str, shape: tuple[int, ...], g: torch.Generator, n_experts: int) -> torch.Tensor:
    """A sensitive random value for the tensor called `name` (see `init_weights`)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        vocab, k = shape
        return torch.rand(vocab, n_experts, generator=g).argsort(dim=-1)[:, :k]
    if leaf.endswith("_scale"):  # mHC scales, never block scales
        return torch.rand(shape, generator=g) + 0.5
    if leaf in ("attn_sink", "ape") or leaf.endswith("_base"):
        return torch.randn(shape, generator=g) * 0.5
    if leaf == "bias":
        return torch.randn(shape, generator=g) * 0.1
    if name.endswith("norm.weight"):
        return 1 + torch.randn(shape, generator=g) * 0.1
    if name == "embed.weight":
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5

