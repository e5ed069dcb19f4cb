"""Shared by the drafter tests: the tiny V4 target (shipped `tiny-v4` config, seed 0)."""

import pytest
from draft_targets import tiny_v4_config

import dspark


@pytest.fixture(scope="module")
def tiny():
    return dspark.init_model(tiny_v4_config(), seed=0)
