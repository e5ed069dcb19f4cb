"""`static_decode` on the GPU: the engine's decoding rounds replay CUDA graphs (one per bucket of slots
and verify width) and give the default engine's greedy tokens (and n-gram drafts) (tiny-v4, fp32,
the Triton kernels); staggered arrivals make the live slots move (compaction) and the steps change
bucket (1, 2 and 3 of the 3 slots).
With DSpark the rounds draft on the static drafter: greedy propose and observe replay their own
graphs (the dynamic `DSparkDrafter.propose` is forbidden), sampled rounds replay its sampled propose graphs (noise keyed by each request's seed)."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.engine import Engine, EngineConfig
from dspark.engine.engine import static_by_default
from dspark.engine.slots import buckets
from dspark.kernels import KernelConfig
from dspark.sampling import SamplingParams


def _run(model, prompts, params=lambda i: SamplingParams(), **config):
    engine = Engine(model, EngineConfig(max_running=3, prefill_chunk=7, max_prompt_tokens=48, max_new_tokens=24,
                                        trace=True, **config))
    engine.replayed = set()  # the (b, t) of every static step, each checked to be a captured graph's
    if engine.runner is not None:
        step = engine.runner.step

        def stepping(ids, starts):
            assert tuple(ids.shape) in engine.runner.graphs
            engine.replayed.add(tuple(ids.shape))
            return step(ids, starts)

        engine.runner.step = stepping
    tokens, pending = {}, list(enumerate(prompts))
    while pending or engine.has_work():
        for _ in range(min(2, len(pending))):
            i, p = pending.pop(0)
            engine.add_request(p, params(i), 16, request_id=f"r{i}")
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
    return tokens, [(r["draft"], r["accepted"]) for r in engine.take_trace()], engine


def _model_and_drafter(dtype=None):
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    model = dspark.init_model(config, seed=0, device="cuda", dtype=dtype, kernels=KernelConfig.for_device("cuda"))
    return model, DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=16)).init_weights(3)


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 25, 38, 7)]


def _forbid_dynamic_propose(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("static_decode drafted with the dynamic DSparkDrafter.propose")

    monkeypatch.setattr(DSparkDrafter, "propose", forbidden)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "ngram_auto", "dspark3", "dspark_auto"])
def test_static_decode_graphs_equal_the_default_engine(mode, monkeypatch):
    model, dsp = _model_and_drafter()
    drafter = {"none": {}, "ngram_auto": dict(draft_tokens="auto", drafter="ngram"),
               "dspark3": dict(draft_tokens=3, drafter=dsp), "dspark_auto": dict(draft_tokens="auto", drafter=dsp)}[mode]
    prompts = _prompts()
    default, default_trace, _ = _run(model, prompts, static_decode=False, **drafter)
    if mode.startswith("dspark"):
        _forbid_dynamic_propose(monkeypatch)
    static, static_trace, engine = _run(model, prompts, static_decode=True, **drafter)
    widths = list(range(1, engine.runner.shape.tokens + 1))
    keys = [(b, t) for b in buckets(3) for t in widths]  # buckets(3) = [1, 2, 3]
    assert sorted(engine.runner.graphs) == keys
    assert {b for b, _ in engine.replayed} == {1, 2, 3}
    if mode.startswith("dspark"):  # the static drafter's graphs: observe per (bucket, width), propose per bucket
        assert sorted(engine.static_draft.observe_graphs) == keys
        assert {b for b, _ in engine.static_draft.propose_graphs} == {1, 2, 3}  # per (bucket, width)
    else:
        assert engine.static_draft is None
    assert static == default
    if not mode.startswith("dspark"):  # n-gram drafts depend on the tokens only; DSpark's on streams equal to ~1e-3
        assert static_trace == default_trace


@pytest.mark.gpu
def test_static_decode_sampled_dspark_rounds_run_and_free_their_slots(monkeypatch):
    """Mixed batches (T = 1 and greedy requests, budget 3) on the sampled static propose's graphs (noise
    keyed by each request's seed): every request completes, greedy ones with the default engine's tokens,
    sampled drafts are accepted at times, every slot is given back. fp32 target: the sampled requests
    finish at other steps than in the default engine, so the greedy ones run in other buckets, whose
    bf16 rounding flipped a near-tied greedy token of the random model on the H200."""
    model, dsp = _model_and_drafter(torch.float32)
    prompts = _prompts()
    params = lambda i: SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams()  # noqa: E731
    default, _, _ = _run(model, prompts, params, draft_tokens=3, drafter=dsp, static_decode=False)
    _forbid_dynamic_propose(monkeypatch)
    static, trace, engine = _run(model, prompts, params, draft_tokens=3, drafter=dsp, static_decode=True)
    assert engine.static_draft.static.noise_keys.device.type == "cuda"
    assert engine.static_draft.sampled_graphs.graphs  # the sampled rounds replayed their buckets' graphs
    assert sorted(static) == sorted(default) and all(static[f"r{i}"] == default[f"r{i}"] for i in (0, 2, 4))
    assert all(len(static[f"r{i}"]) == 16 or static[f"r{i}"][-1] == model.config.eos_token_id for i in (1, 3))
    assert sum(accepted for _, accepted in trace) > 0
    assert engine.slots.free == engine.slots.slots and not engine.has_work()


@pytest.mark.gpu
def test_static_decode_is_the_default_on_cuda():
    """EngineConfig(static_decode=None): a V4 target on CUDA with the Triton MoE takes the static path
    (its greedy tokens are the dynamic path's); with the torch reference
    MoE, which reads expert counts on the host, it stays dynamic."""
    model, _ = _model_and_drafter()
    assert static_by_default(model)
    prompts = _prompts()
    auto, _, engine = _run(model, prompts)
    dynamic, _, _ = _run(model, prompts, static_decode=False)
    assert engine.static and engine.runner.graphs and engine.replayed
    assert auto == dynamic
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    reference = dspark.init_model(config, seed=0, device="cuda", kernels=KernelConfig.uniform("ref"))
    assert not static_by_default(reference)


@pytest.mark.gpu
def test_overlap_keeps_a_step_in_flight_with_the_same_tokens():
    """`overlap=True` on CUDA graphs: plain greedy rounds read each step's tokens behind an event while
    the next step runs; tokens equal the synchronous static and dynamic engines'; most steps come from
    the step in flight."""
    from dspark.engine.lookahead import Lookahead

    model, _ = _model_and_drafter()
    prompts = _prompts()
    dynamic, _, _ = _run(model, prompts, static_decode=False)
    static, _, _ = _run(model, prompts, static_decode=True)
    counts = {"host": 0}
    from_host = Lookahead._launch_from_host

    def counting(self, *args):
        counts["host"] += 1
        return from_host(self, *args)

    Lookahead._launch_from_host = counting
    try:
        ahead, _, engine = _run(model, prompts, static_decode=True, overlap=True)
    finally:
        Lookahead._launch_from_host = from_host
    assert ahead == static == dynamic
    assert engine.lookahead is not None and engine.replayed and counts["host"] > 0
    assert engine.slots.free == engine.slots.slots


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
def test_static_mtp_rounds_replay_graphs_with_the_default_engine_tokens(sampled, monkeypatch):
    """MTP-1 on the static path (fp32 target: CUDA's default bf16 lets the two engines' different
    batch shapes flip near-tied greedy tokens of a random model once sampled requests make the
    batches differ): greedy rounds replay the MTP observe graph of each (bucket, width) and the propose
    graph of each bucket (the dynamic `MtpDrafter.propose` is forbidden) and give the default engine's
    tokens and, all greedy, its drafts in nearly every round (the random drafter is accepted about once
    in 60 rounds, so acceptance alone would not show wrong drafts); with sampled requests in the batch
    the sampled static propose graphs run, greedy requests keep their tokens and every slot is given
    back."""
    from dspark.draft import MtpDrafter

    model, _ = _model_and_drafter(torch.float32)
    prompts = _prompts()
    params = (lambda i: SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams()) if sampled \
        else (lambda i: SamplingParams())
    default, default_trace, _ = _run(model, prompts, params, draft_tokens=1, drafter=MtpDrafter(model),
                                     static_decode=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("static_decode drafted with the dynamic MtpDrafter.propose")

    monkeypatch.setattr(MtpDrafter, "propose", forbidden)
    static, trace, engine = _run(model, prompts, params, draft_tokens=1, drafter=MtpDrafter(model), static_decode=True)
    keys = [(b, t) for b in buckets(3) for t in (1, 2)]
    assert sorted(engine.static_draft.observe_graphs) == keys and sorted(engine.static_draft.propose_graphs) == [1, 2, 3]
    greedy = range(len(prompts)) if not sampled else (0, 2, 4)
    assert all(static[f"r{i}"] == default[f"r{i}"] for i in greedy) and sorted(static) == sorted(default)
    if sampled:
        assert engine.static_draft.sampled_graphs.graphs
    else:
        assert len(trace) == len(default_trace)
        same = sum(s == d for s, d in zip(trace, default_trace))
        assert same >= 0.9 * len(trace), f"static MTP drafts equal the dynamic drafter's in {same} of {len(trace)} rounds"
    assert engine.slots.free == engine.slots.slots and not engine.has_work()


@pytest.mark.gpu
def test_static_mtp_is_the_default_on_cuda():
    """EngineConfig(static_decode=None) with an MTP drafter on CUDA: the rounds draft on the static MTP
    slots (graphs captured), as with DSpark."""
    from dspark.draft import MtpDrafter
    from dspark.engine.static_mtp_draft import StaticMtpRunner

    model, _ = _model_and_drafter()
    engine = Engine(model, EngineConfig(max_running=2, max_prompt_tokens=48, max_new_tokens=8, draft_tokens=1,
                                        drafter=MtpDrafter(model)))
    assert engine.static and isinstance(engine.static_draft, StaticMtpRunner) and engine.static_draft.propose_graphs
