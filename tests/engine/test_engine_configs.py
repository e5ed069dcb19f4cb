"""The shipped benchmark configs: v4-mini as the shared benchmark defines it, and its V4.1 analogue
of similar size (both built on the meta device: no weights are materialised)."""

import json
from pathlib import Path

import pytest
import torch

from dspark.configs import NAMES, load_config
from dspark.engine.footprint import target_footprint
from dspark.models.deepseek_v4.config import DeepseekV4Config
from dspark.models.deepseek_v4.model import DeepseekV4ForCausalLM
from dspark.models.deepseek_v41.config import DeepseekV41Config
from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM

# ../shared next to the repository (a worktree may sit one level deeper than the main checkout)
_ROOT = Path(__file__).resolve().parents[2]
SHARED = next((p for p in (_ROOT.parent / "shared/bench/v4-mini.json", _ROOT.parent.parent / "shared/bench/v4-mini.json")
               if p.is_file()), _ROOT.parent / "shared/bench/v4-mini.json")


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.skipif(not SHARED.is_file(), reason="the shared benchmark folder is not next to this checkout")
def test_v4_mini_is_the_shared_benchmark_config():
    assert load_config("v4-mini") == json.loads(SHARED.read_text())


def test_mini_configs_build_at_the_documented_size():
    v4 = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(load_config("v4-mini")), torch.bfloat16, "meta")
    v41 = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(load_config("v41-mini")), torch.bfloat16, "meta")
    main_v4 = _params(v4) - _params(v4.mtp)
    assert 3.2e9 < main_v4 < 3.4e9  # "about 3.3 B parameters" (shared/bench/README.md), MTP aside
    assert abs(_params(v41) / main_v4 - 1) < 0.15  # "of similar size"
    c = v41.config
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok) == (2048, 12, 64, 6)
    # both have state of every kind the engine pages
    kinds4 = {k.name for k in target_footprint(v4.config, 2)}
    kinds41 = {k.name for k in target_footprint(c, 2)}
    assert {"window_kv", "compressed_kv", "indexer_keys", "compressor_buffers"} <= kinds4 & kinds41


def test_unknown_shipped_config_is_named():
    assert set(NAMES) >= {"v4-mini", "v41-mini", "tiny-v4", "tiny-v41"}
    with pytest.raises(ValueError, match="v5-mini"):
        load_config("v5-mini")
