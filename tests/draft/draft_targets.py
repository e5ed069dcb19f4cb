"""The tiny V4 target config the drafter tests share (shipped `tiny-v4`, with overrides)."""

from dspark.configs import load_config


def tiny_v4_config(**overrides) -> dict:
    """The shipped tiny-v4 config dict with `overrides` applied."""
    return dict(load_config("tiny-v4"), **overrides)
