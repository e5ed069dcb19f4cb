"""The shipped dspark-tiny pair: loads offline, speculative greedy output equals plain output, and
the trained drafter keeps its acceptance (a floor set from the measured value, so a regression in the
drafter, the verifier or the loop shows up here)."""

import pytest
import torch

import dspark

PROMPTS = {
    "code": ["def read_config(path):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n",
             "class Cache:\n    def __init__(self, size):\n", "    for key, value in items:\n        if "],
    "prose": ["ROMEO.\nBut soft, what light through yonder", "KING.\nNow, my good lords,",
              "Enter HAMLET.\n\nHAMLET.\n", "What say you to this, my lord?\n"],
}
# Measured on this pair at commit time (budget 5, 48 new tokens, greedy): τ 2.89 (code), 4.18 (prose)
# (`bench/tiny_acceptance.py`); the first-round drafter had 1.49 / 1.66, below these floors.
TAU_FLOOR = {"code": 2.5, "prose": 3.6}


@pytest.fixture(scope="module")
def tiny():
    return dspark.load_model("tiny")


def test_embedded_pair_loads_with_tokenizer_and_drafter(tiny):
    assert type(tiny).__name__ == "DeepseekV41ForCausalLM"
    assert tiny.tokenizer is not None and tiny.dspark is not None
    assert tiny.dspark.block_size == 5
    # STS-calibrated on held-out rounds (sts.json beside the drafter), one temperature per position
    assert tiny.dspark.calibration is not None and len(tiny.dspark.calibration.temperatures) == 5
    assert tiny.cache_qat is False  # trained without the FP8 cache rounding; its config.json says so
    text = dspark.generate(tiny, "def fibonacci(n):", max_new_tokens=8).text
    assert isinstance(text, str) and text


def test_the_drafter_ships_a_table_per_device_type_labelled_with_its_device(tiny):
    """"auto" reads the table of the model's device type by default (`engine.default_capacity`): a CPU
    core's, and the engine rounds of one H200 (`dspark profile --engine`) on CUDA, greedy and sampled
    (`--temperature 1`: a sampled round on the static path is synchronous, and drafting costs more)."""
    from dspark.engine.engine import default_capacity

    tables = tiny.dspark.capacity_tables
    assert sorted(tables) == ["cpu", "cuda", "cuda-h100", "cuda-h100-sampled", "cuda-sampled"]
    assert tables["cuda"].label.startswith("NVIDIA H200") and "engine rounds" in tables["cuda"].label
    assert tables["cpu"].label.startswith("cpu")
    assert default_capacity(tiny.dspark, "cuda") is tables["cuda"]
    assert default_capacity(tiny.dspark, "cpu") is tables["cpu"]
    assert default_capacity(tiny.dspark, "cuda", sampled=True) is tables["cuda-sampled"]
    assert default_capacity(tiny.dspark, "cpu", sampled=True) is tables["cpu"]  # no sampled CPU table
    sampled = tables["cuda-sampled"]
    assert sampled.label.startswith("NVIDIA H200") and sampled.label.endswith("T=1")
    assert sampled.conditions["temperature"] == 1.0
    # with two or four requests, a sampled drafting round costs more plain rounds than a greedy one
    greedy = tables["cuda"]
    for r in (2, 4):
        for n in range(1, tiny.dspark.block_size + 1):
            assert sampled.plain(r) / sampled(r * (1 + n)) > greedy.plain(r) / greedy(r * (1 + n)), (r, n)
    # graph rounds: a plain round of one request under a millisecond, every drafting round dearer
    assert 1.0 / tables["cuda"].plain(1) < 1e-3 < 1.0 / tables["cuda"](2)


@pytest.mark.parametrize("domain", sorted(PROMPTS))
def test_speculative_equals_plain_and_tau_stays_above_floor(tiny, domain):
    plain = dspark.generate(tiny, PROMPTS[domain], max_new_tokens=48)
    spec = dspark.generate(tiny, PROMPTS[domain], max_new_tokens=48, draft_tokens=5)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    rounds = sum(o.stats.rounds for o in spec)
    tau = sum(o.stats.new_tokens - 1 for o in spec) / rounds
    print(f"{domain}: tau {tau:.2f} over {rounds} rounds")
    assert tau >= TAU_FLOOR[domain]


def test_the_drafter_ships_h100_tables_that_an_h100_takes(tiny, monkeypatch):
    """On an H100 the default tables are the ones measured there (on it the H200's had sampled "auto" at
    0.77 of plain decoding, its own 1.01; bench/README.md, twenty-second session): engine rounds, and
    sampled rounds as "auto" runs them (`--auto-rounds`), where drafting never pays for dspark-tiny."""
    from dspark.engine import engine as engine_module

    tables = tiny.dspark.capacity_tables
    h100 = "NVIDIA H100 80GB HBM3"
    assert tables["cuda-h100"].conditions["device"] == h100 and "engine rounds" in tables["cuda-h100"].label
    sampled = tables["cuda-h100-sampled"]
    assert sampled.conditions["device"] == h100 and sampled.conditions["rounds"] == "auto"
    assert sampled.conditions["temperature"] == 1.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "device_name", lambda device: h100)
    assert engine_module.default_capacity(tiny.dspark, "cuda") is tables["cuda-h100"]
    assert engine_module.default_capacity(tiny.dspark, "cuda", sampled=True) is sampled
    assert engine_module.foreign_table(sampled, torch.device("cuda")) is None
    for r in (1, 2, 4):  # a drafting round of any budget costs more than 1.7 plain ones
        assert all(sampled.plain(r) / sampled(r * (1 + n)) > 1.7 for n in range(1, tiny.dspark.block_size + 1))
