"""`DSparkConfig`: V4 checkpoint names and defaults, target-fitted defaults, every bad value named."""

import json
from importlib import resources

import pytest

from dspark.draft import DSparkConfig
from dspark.models.deepseek_v4 import DeepseekV4Config


@pytest.fixture(scope="module")
def tiny_config():
    text = resources.files("dspark.configs").joinpath("tiny-v4.json").read_text()
    return DeepseekV4Config.from_dict(json.loads(text))


def test_defaults_are_the_v4_flash_checkpoint_values():
    c = DSparkConfig()
    assert (c.dspark_block_size, c.dspark_noise_token_id, c.dspark_target_layer_ids, c.dspark_markov_rank) == \
        (5, 128799, (40, 41, 42), 256)
    assert c.num_stages == 3 and c.dspark_markov_head_type == "markov" and c.dspark_confidence_with_markov


def test_from_a_target_config_dict_reads_only_dspark_keys():
    released = {"vocab_size": 129280, "num_hidden_layers": 43, "dspark_block_size": 5,
                "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256,
                "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3}
    c = DSparkConfig.from_dict(released)
    assert c.dspark_target_layer_ids == (40, 41, 42) and c.dspark_n_activated_experts == 3
    assert DSparkConfig.from_dict(c.to_dict()) == c
    assert json.loads(json.dumps(c.to_dict())) == c.to_dict()


def test_for_target_fits_layers_noise_token_window_and_experts(tiny_config):
    c = DSparkConfig.for_target(tiny_config, dspark_markov_rank=16)
    assert c.dspark_target_layer_ids == (3, 4, 5)  # inputs of the last three layers, as 40..42 of 43
    assert c.dspark_noise_token_id == 257  # 128799 does not fit a 258-token vocabulary
    assert c.window(tiny_config) == tiny_config.sliding_window == 8
    assert c.n_routed_experts(tiny_config) == 8 and c.n_activated_experts(tiny_config) == 2
    c.check_target(tiny_config)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(dspark_block_size=0), "dspark_block_size"),
    (dict(dspark_block_size=2.5), "dspark_block_size"),
    (dict(dspark_noise_token_id=-1), "dspark_noise_token_id"),
    (dict(dspark_target_layer_ids=()), "dspark_target_layer_ids"),
    (dict(dspark_target_layer_ids=(3, 3)), "strictly increasing"),
    (dict(dspark_target_layer_ids=(4, 2)), "strictly increasing"),
    (dict(dspark_target_layer_ids="40"), "dspark_target_layer_ids"),
    (dict(dspark_markov_rank=0), "dspark_markov_rank"),
    (dict(dspark_n_routed_experts=0), "dspark_n_routed_experts"),
    (dict(dspark_n_routed_experts=4, dspark_n_activated_experts=5), "dspark_n_activated_experts"),
    (dict(dspark_markov_head_type="gated"), "dspark_markov_head_type"),
    (dict(dspark_confidence_with_markov="yes"), "dspark_confidence_with_markov"),
    (dict(dspark_sliding_window=0), "dspark_sliding_window"),
])
def test_bad_values_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DSparkConfig(**kwargs)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(dspark_noise_token_id=300), "dspark_noise_token_id"),
    (dict(dspark_target_layer_ids=(5, 7)), "dspark_target_layer_ids"),
    (dict(dspark_n_activated_experts=9), "dspark_n_activated_experts"),
])
def test_values_that_do_not_fit_the_target_are_named(tiny_config, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DSparkConfig.for_target(tiny_config, **kwargs).check_target(tiny_config)
