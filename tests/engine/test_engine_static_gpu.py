"""`static_decode` on the GPU: the engine's decoding rounds replay CUDA graphs (one per verify width)
and give the default engine's greedy tokens (and n-gram drafts) (tiny-v4, fp32, the Triton kernels)."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.engine import Engine, EngineConfig
from dspark.kernels import KernelConfig
from dspark.sampling import SamplingParams


def _run(model, prompts, **config):
    engine = Engine(model, EngineConfig(max_running=3, prefill_chunk=7, max_prompt_tokens=48, max_new_tokens=24,
                                        trace=True, **config))
    tokens, pending = {}, list(enumerate(prompts))
    while pending or engine.has_work():
        for _ in range(min(2, len(pending))):
            i, p = pending.pop(0)
            engine.add_request(p, SamplingParams(), 16, request_id=f"r{i}")
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
    return tokens, [(r["draft"], r["accepted"]) for r in engine.take_trace()], engine


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "ngram_auto", "dspark3"])
def test_static_decode_graphs_equal_the_default_engine(mode):
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    model = dspark.init_model(config, seed=0, device="cuda", kernels=KernelConfig.for_device("cuda"))
    dsp = DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=16)).init_weights(3)
    drafter = {"none": {}, "ngram_auto": dict(draft_tokens="auto", drafter="ngram"),
               "dspark3": dict(draft_tokens=3, drafter=dsp)}[mode]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 25, 38, 7)]
    default, default_trace, _ = _run(model, prompts, **drafter)
    static, static_trace, engine = _run(model, prompts, static_decode=True, **drafter)
    assert sorted(engine.runner.graphs) == list(range(1, engine.runner.shape.tokens + 1))
    assert static == default
    if mode != "dspark3":  # n-gram drafts depend on the tokens only; DSpark's on streams equal to ~1e-3
        assert static_trace == default_trace
