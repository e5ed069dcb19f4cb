"""The DSpark draft network for a DeepSeek-V4 target: three stages `mtp.0..2` (dspark spec §7).

    main_x_i  = main_norm(main_proj(concat_ℓ mean_streams(F^ℓ_i)))      [D]   stage 0's weights
    X         = embed([anchor, noise × (γ−1)]) copied into n_hc streams  [γ, n_hc, D]  frozen target embed
    for each stage s:  X = Stage_s(X; context keys RoPE(kv_norm(wkv_s · main_x)) of the window)
    x_k       = hc_head(X)_k          (pre-norm collapse; the confidence head's input)   [D]
    U_k       = head(norm(x_k))       (frozen target LM head)                               [V]
    L_k       = U_k + MarkovBias(x_{k−1}),  z_k = proj([x_k ; W1[x_{k−1}]])

F^ℓ_i are the target's *input* streams of layer ℓ at position i (`DeepseekV4Output.features`).
Parameter names are the shipped checkpoint keys: `mtp.0.main_proj.weight`, `mtp.0.main_norm.weight`,
`mtp.{s}.attn.*`, `mtp.{s}.ffn.*`, `mtp.{s}.hc_{attn,ffn}_*`, `mtp.2.norm.weight`, `mtp.2.hc_head_*`,
`mtp.2.markov_head.{embed,head}.weight`, `mtp.2.confidence_head.proj.weight`. The target's embedding
and head are *not* parameters here: they are passed in (shared and frozen, spec §1.5).

This module only computes; `DSparkDrafter` (inference) and `dspark.train` (training) assemble its
inputs. Shape symbols: N blocks, γ slots, S = N·γ block rows, P context pool rows, W window,
D hidden, d head_dim, V vocabulary, r Markov rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.draft.confidence import ConfidenceHead
from dspark.draft.config import DSparkConfig
from dspark.draft.markov_head import MarkovHead, build_head
from dspark.draft.stages import BlockRows, DSparkStage, share_ropes
from dspark.draft.stages_v41 import DSparkStageV41
from dspark.kernels import KernelConfig
from dspark.models.deepseek_v4.config import DeepseekV4Config
from dspark.models.deepseek_v4.mhc import collapse
from dspark.models.deepseek_v4.model import resolve_kernels
from dspark.models.deepseek_v41.block import initial_pre
from dspark.models.deepseek_v41.config import DeepseekV41Config

# Stage kinds: "v4" V4 blocks (what `dspark train-draft` builds, for any DeepSeek target);
# "shipped" the target family's own released stages (a V4.1 target: V4.1 blocks, `stages_v41.py`).
STAGE_KINDS = ("v4", "shipped")


@dataclass
class BlockOutput:
    """Backbone output for N blocks of γ slots, past the backbone only for the first k ≤ γ of each
    (`DSparkModel.blocks`' `n_draft`; k = γ unless asked for fewer).

    hidden_pre [N, k, D] pre-norm collapse (confidence input); hidden [N, k, D] after `norm`
    (LM-head and RNN-head input); base fp32 [N, k, V] base logits U_k.
    """

    hidden_pre: torch.Tensor
    hidden: torch.Tensor
    base: torch.Tensor


def check_n_draft(n_draft, gamma: int) -> int:
    """The leading slots k of a γ-block to draft: `n_draft` (an int in [1, γ]) or γ when None.
    ValueError names a bad value."""
    if n_draft is None:
        return gamma
    if isinstance(n_draft, bool) or not isinstance(n_draft, int) or not 1 <= n_draft <= gamma:
        raise ValueError(f"n_draft must be None or an int in [1, γ={gamma}], got {n_draft!r}")
    return n_draft


def target_kernels(target) -> KernelConfig | None:
    """The kernel choice of `target` (DeepSeek targets hold one as `.kernels`); None for a target
    without one (an HF target), which `DSparkModel` resolves from the device."""
    kernels = getattr(target, "kernels", None)
    return kernels if isinstance(kernels, KernelConfig) else None


def uses_v41_stages(target_config, stage_kind: str) -> bool:
    """Whether stages of `stage_kind` for `target_config` are V4.1 blocks (released V4.1 stages)."""
    if stage_kind not in STAGE_KINDS:
        raise ValueError(f"stage_kind: {stage_kind!r} is not one of {STAGE_KINDS}")
    return stage_kind == "shipped" and isinstance(target_config, DeepseekV41Config)


def stage_config(config: DSparkConfig, target_config, stage_kind: str = "v4"):
    """The target config with the stages' expert counts and window: what each stage block is built from.

    With `stage_kind` "v4" a DeepSeek-V4.1 target gets V4-style stages of its own shapes (a one-layer
    sliding-window V4 config): a drafter we train need not use V4.1 blocks. With "shipped" a V4.1
    target keeps its own config (the released stages are V4.1 blocks, deepseek_v41 spec §9).
    """
    if uses_v41_stages(target_config, stage_kind):
        return dataclasses.replace(target_config, n_routed_experts=config.n_routed_experts(target_config),
                                   num_experts_per_tok=config.n_activated_experts(target_config),
                                   sliding_window=config.window(target_config))
    if hasattr(target_config, "draft_stage_config"):  # a non-DeepSeek target sizes its stages (hf_causal)
        target_config = target_config.draft_stage_config()
    elif not isinstance(target_config, DeepseekV4Config):
        target_config = _v4_stage_base(target_config)
    return dataclasses.replace(target_config, n_routed_experts=config.n_routed_experts(target_config),
                               num_experts_per_tok=config.n_activated_experts(target_config),
                               sliding_window=config.window(target_config))


_STAGE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                 "o_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                 "n_shared_experts", "sliding_window", "qk_rope_head_dim", "rope_theta", "compress_rope_theta",
                 "max_position_embeddings", "routed_scaling_factor", "swiglu_limit", "scoring_func", "hc_mult",
                 "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps")


def _v4_stage_base(target_config) -> DeepseekV4Config:
    """A one-layer SWA/score-MoE V4 config with the shapes of another DeepSeek target (V4.1)."""
    fields = {name: getattr(target_config, name) for name in _STAGE_FIELDS}
    return DeepseekV4Config.from_dict(dict(fields, model_type="deepseek_v4", num_hidden_layers=1,
                                           layer_types=["sliding_attention"], mlp_layer_types=["moe"],
                                           num_nextn_predict_layers=0, index_n_heads=1, index_head_dim=8,
                                           index_topk=1))


class DSparkModel(nn.Module):
    """The trainable part of DSpark: `mtp` (one `DSparkStage` per target layer id) and its heads.

    Built with the module dtype of the linears (`dtype`, default fp32); norms, sinks, mHC
    parameters, the Markov and confidence heads stay fp32. Do not re-cast it afterwards.
    `stage_kind` (see `STAGE_KINDS`) picks the stage module: "shipped" for a V4.1 target builds
    `DSparkStageV41` (the released `mtp.0..2`), otherwise `DSparkStage`; `cache_qat` is the V4.1
    target's FP8 window rounding, used by V4.1 stages only. `kernels` is the kernel choice of the
    target it drafts for (pass `target.kernels`); None: `KernelConfig.for_device(device)`, as a
    target's default. Under autograd the stages run the torch references (`stage_kernels.py`).
    """

    def __init__(self, config: DSparkConfig, target_config, dtype: torch.dtype | None = None, device=None,
                 stage_kind: str = "v4", cache_qat: bool = True, kernels: KernelConfig | None = None):
        super().__init__()
        config.check_target(target_config)
        self.config = config
        self.target_config = target_config  # what the stages were sized from (`io.save_drafter` records it)
        self.stage_kind = stage_kind
        self.dtype = dtype or torch.float32
        self.gamma = config.dspark_block_size
        self.window = config.window(target_config)
        c = stage_config(config, target_config, stage_kind)
        self.n_hc = c.hc_mult  # the stages' streams (a DeepSeek target's own; an HF target's stage shape)
        self.head_dim = c.head_dim
        n, d = config.num_stages, target_config.hidden_size
        self.kernels = resolve_kernels(kernels, device)
        self.carries_pre = uses_v41_stages(target_config, stage_kind)
        built = dict(dtype=self.dtype, device=device, kernels=self.kernels)
        if self.carries_pre:
            stages = (DSparkStageV41(c, i, i == 0, i == n - 1, n, cache_qat, **built) for i in range(n))
        else:
            stages = (DSparkStage(c, i == 0, i == n - 1, n, **built) for i in range(n))
        self.mtp = nn.ModuleList(stages)
        share_ropes(self.mtp)
        last = self.mtp[-1]
        r = config.dspark_markov_rank
        last.markov_head = build_head(config.dspark_markov_head_type, target_config.vocab_size, r, d, device,
                                      self.kernels)
        last.confidence_head = ConfidenceHead(d, r, config.dspark_confidence_with_markov, device)

    @property
    def markov_head(self) -> MarkovHead:
        return self.mtp[-1].markov_head

    @property
    def confidence_head(self) -> ConfidenceHead:
        return self.mtp[-1].confidence_head

    @property
    def device(self) -> torch.device:
        return self.mtp[0].main_proj.weight.device

    # ---------------------------------------------------------------------------------------
    # Context
    # ---------------------------------------------------------------------------------------

    def main_x(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """Fused target features: {layer id: [n, n_hc, D]} -> [n, D] (stream mean, concat, project, norm)."""
        parts = [features[i].float().mean(dim=-2) for i in self.config.dspark_target_layer_ids]
        first = self.mtp[0]
        return first.main_norm(first.main_proj(torch.cat(parts, dim=-1).to(self.dtype)))

    def context_latents(self, main_x: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per stage the context keys of rows main_x [n, D] at positions [n]: list of [n, d]."""
        return [stage.context_latents(main_x, positions) for stage in self.mtp]

    # ---------------------------------------------------------------------------------------
    # Blocks
    # ---------------------------------------------------------------------------------------

    def blocks(self, embeds: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
               pools: list[torch.Tensor], ctx_index: torch.Tensor, head_weight: torch.Tensor,
               n_draft: int | None = None) -> BlockOutput:
        """Run the stages over N blocks.

        embeds [S, D] target embeddings of the block ids [S] (γ consecutive rows per block);
        positions [S]; pools per stage [P, d]; ctx_index [S, W] pool rows each row sees;
        head_weight [V, D] the target LM head (frozen: pass it detached when training);
        n_draft k in [1, γ] (default γ): the leading slots of each block taken past the backbone.
        The stages attend both ways inside a block, so they run all γ slots whatever k; the norm and
        the LM head are per row and run only the N·k rows a caller drafts from (`check_n_draft`).
        """
        k = check_n_draft(n_draft, self.gamma)
        x = embeds.to(self.dtype).unsqueeze(-2).expand(-1, self.n_hc, -1).contiguous()  # [S, n_hc, D]
        last = self.mtp[-1]
        rows = BlockRows(positions, self.gamma)  # the stages' shared RoPE rows and own-block pool rows
        if self.carries_pre:  # V4.1 stages: single-pass mHC, one-hot pre into stage 0, last FFN pre out
            mix = initial_pre(x.shape[0], self.n_hc, x.device)
            for stage, pool in zip(self.mtp, pools):
                x, mix = stage(x, mix, ids, positions, pool, ctx_index, self.gamma, rows)
            pre = collapse(x, mix)  # [S, D]
        else:
            for stage, pool in zip(self.mtp, pools):
                x = stage(x, ids, positions, pool, ctx_index, self.gamma, rows)
            pre = last.collapse(x)  # [S, D]
        n = embeds.shape[0] // self.gamma
        # The first k rows of each block, contiguous ([N·k, D]; with k = γ a view, no copy).
        pre = pre.view(n, self.gamma, -1)[:, :k].reshape(n * k, -1)
        hidden = last.norm(pre)
        # The head runs in its own (the target's) dtype, as the target's logits do; casting the small
        # hidden rather than the [V, D] head avoids copying the head every call.
        base = F.linear(hidden.to(head_weight.dtype), head_weight).float()  # [N·k, V]
        return BlockOutput(pre.view(n, k, -1), hidden.view(n, k, -1), base.view(n, k, -1))

    def teacher_forced(self, out: BlockOutput, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training view (spec §5.4): draft logits and confidence logits from the true previous tokens.

        prev LongTensor [N, γ] = [x_a, x*_0, .., x*_{γ−2}] -> (logits fp32 [N, γ, V], z fp32 [N, γ]).
        """
        head = self.markov_head
        logits = out.base + head.teacher_forced(prev, out.hidden)
        return logits, self.confidence_head(out.hidden_pre, head.embed(prev))

    # ---------------------------------------------------------------------------------------
    # Random initialisation
    # ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> DSparkModel:
        """Draw every parameter from a seeded CPU generator (device-independent); see `initial_value`."""
        g = torch.Generator().manual_seed(seed)
        for name, tensor in sorted(self.state_dict(keep_vars=True).items()):
            tensor.copy_(initial_value(name, tuple(tensor.shape), g))
        return self


def initial_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Starting value of parameter `name`.

    Linears N(0, 1/fan_in) so activations stay O(1) through a stage; norms 1; sinks and router bias 0;
    mHC `fn` small N(0, 0.1/√fan_in) with `base` 0 and `scale` 1, so every site starts near the
    neutral mix (pre = σ(0), post = 1, comb ≈ uniform) but still depends on its input; Markov W1 N(0, 1)
    and W2 N(0, 0.1/√r), so the bias starts small against the target head's logits; the confidence
    projection N(0, 1/fan_in).
    """
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if leaf in ("attn_sink", "bias", "bias_vl") or leaf.endswith("_base"):
        return torch.zeros(shape)
    if leaf.endswith("_scale"):
        return torch.ones(shape)
    if leaf.endswith("_fn"):
        return torch.randn(shape, generator=g) * 0.1 * shape[-1] ** -0.5
    if name.endswith("markov_head.embed.weight"):
        return torch.randn(shape, generator=g)
    if name.endswith("markov_head.head.weight"):
        return torch.randn(shape, generator=g) * 0.1 * shape[-1] ** -0.5
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5
