"""Model configs shipped with dspark (`config.json` dicts), by name: see README.md here for where
each comes from. `init_model("v4-mini")` builds one with random weights."""

from __future__ import annotations

import json
from importlib import resources

NAMES = ("tiny-v4", "tiny-v41", "v4-mini", "v41-mini")


def load_config(name: str) -> dict:
    """The `config.json` dict of a shipped config; ValueError naming an unknown one."""
    if name not in NAMES:
        raise ValueError(f"unknown shipped config {name!r}; available: {', '.join(NAMES)}")
    return json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text())
