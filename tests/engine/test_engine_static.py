"""`EngineConfig(static_decode=True)`: decoding rounds on the static slots give the default engine's
tokens and drafts, slots are never leaked, and the option is validated.

tiny-v4, fp32, CPU (the static step runs eagerly; CUDA-graph replay of the same step is checked
against it in tests/models/test_deepseek_v4_static_graph_gpu.py). The static step's logits agree with
the dynamic path's to fp32 tolerance, not bit for bit, so greedy tokens and drafts are compared
exactly and confidences to a tolerance. With a DSpark drafter the rounds draft and observe on the
static drafter (`dspark.engine.static_draft`); the dynamic `propose` is forbidden there to prove it.
"""

import json
import random
from importlib import resources

import pytest
import torch
from scipy.stats import chisquare

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter, MtpDrafter
from dspark.engine import Engine, EngineConfig
from dspark.engine.engine import EngineFull, graph_capturable, static_by_default
from dspark.kernels import KernelConfig
from dspark.engine.slots import SlotMove, SlotState, SlotTable, bucket, buckets
from dspark.sampling import SamplingParams

LIMITS = dict(max_prompt_tokens=48, max_new_tokens=24)


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return dspark.init_model(config, seed=0)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _spy_slots(engine):
    """Record the slot moves (src, dst) and every static step's bucket (slots it ran) of `engine`."""
    seen = {"moves": [], "buckets": set()}
    move, step = engine.runner.move, engine.runner.step

    def moving(src, dst):
        seen["moves"].append((src, dst))
        move(src, dst)

    def stepping(ids, starts):
        seen["buckets"].add(ids.shape[0])
        return step(ids, starts)

    engine.runner.move, engine.runner.step = moving, stepping
    return seen


def _staggered(model, prompts, params, new, **config):
    """Two arrivals per step while earlier requests decode (3 running at most, so slots are reused,
    compacted by moves and stepped in buckets of 1, 2 and 3 slots); returns ({request: tokens}, trace)."""
    engine = Engine(model, EngineConfig(max_running=3, prefill_chunk=7, trace=True, **LIMITS, **config))
    seen = _spy_slots(engine) if engine.slots is not None else None
    tokens, pending = {}, list(enumerate(prompts))
    while pending or engine.has_work():
        for _ in range(min(2, len(pending))):
            i, p = pending.pop(0)
            engine.add_request(p, params(i), new, request_id=f"r{i}")
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
        if engine.slots is not None:
            _check_slots(engine)
    if engine.slots is not None:
        assert engine.slots.free == engine.slots.slots
        assert seen["moves"] and seen["buckets"] == {1, 2, 3}, seen
    return tokens, engine.take_trace()


def _check_slots(engine):
    """Every decoding request, and only those, holds a distinct slot; the held slots are 0 .. n − 1."""
    held = engine.slots.holder_slots()
    decoding = {r.request_id: r.state.slot for r in engine.running if isinstance(r.state, SlotState)}
    assert held == decoding
    assert sorted(held.values()) == list(range(len(held))) == list(range(engine.slots.held))
    assert engine.slots.free + len(held) == engine.slots.slots

def random_traffic(engine, steps: int, seed: int) -> tuple[int, int]:
    """`steps` engine steps of random arrivals (0-2 per step; refused ones when full are dropped),
    aborts (a quarter of the steps) and finishes, then steps until no work is left, checking the slots
    after every change (`_check_slots`). Returns (preemptions, decoding request-steps)."""
    rng = random.Random(seed)
    live, preemptions, decoded = set(), 0, 0
    for step in range(steps):
        for _ in range(rng.randint(0, 2)):
            try:
                live.add(engine.add_request(_prompts(1, seed=step)[0], SamplingParams(temperature=1.0, seed=step),
                                            rng.randint(1, 12)))
            except EngineFull:
                pass  # the waiting queue is full: this arrival is refused, as a server would
        if live and rng.random() < 0.25:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim)
            live.discard(victim)
            _check_slots(engine)
        for event in engine.step():
            if event.finished:
                live.discard(event.request_id)
                preemptions += event.stats.preemptions
        decoded += sum(isinstance(r.state, SlotState) for r in engine.running)
        _check_slots(engine)
    while engine.has_work():
        engine.step()
        _check_slots(engine)
    return preemptions, decoded



def _drafters(model):
    dsp = DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=16)).init_weights(3)
    return {"none": dict(), "ngram3": dict(draft_tokens=3, drafter="ngram"),
            "ngram_auto": dict(draft_tokens="auto", drafter="ngram"),
            "dspark3": dict(draft_tokens=3, drafter=dsp),
            # Algorithm 1 on both paths ("async" keeps a round in flight at one budget for the batch)
            "dspark_auto": dict(draft_tokens="auto", drafter=dsp, planner="sync"),
            "mtp1": dict(draft_tokens=1, drafter=MtpDrafter(model))}


@pytest.fixture
def no_dynamic_dspark_propose(monkeypatch):
    """Under static_decode the rounds must draft on the static drafter, never `DSparkDrafter.propose`."""

    def forbidden(*args, **kwargs):
        raise AssertionError("static_decode drafted with the dynamic DSparkDrafter.propose")

    return lambda: monkeypatch.setattr(DSparkDrafter, "propose", forbidden)


@pytest.mark.parametrize("mode", ["none", "ngram3", "ngram_auto", "dspark3", "dspark_auto", "mtp1"])
def test_static_decode_equals_the_default_engine(tiny, mode, no_dynamic_dspark_propose):
    """Greedy tokens for requests of different prompt lengths, admitted mid-run, are identical; so is
    every round's trace: drafts (which depend on the target streams and features the drafter
    observed from the static step; DSpark's come from the static drafter's rings), verified and
    accepted counts; confidences to fp32 tolerance."""
    config = _drafters(tiny)[mode]
    prompts = _prompts(7, seed=11)
    default, trace = _staggered(tiny, prompts, lambda i: SamplingParams(), 16, **config)
    no_dynamic_dspark_propose()
    static, static_trace = _staggered(tiny, prompts, lambda i: SamplingParams(), 16, static_decode=True, **config)
    assert static == default and len(default) == len(prompts)
    assert len(static_trace) == len(trace)
    for a, b in zip(static_trace, trace):
        assert (a["request_id"], a["draft"], a["verified"], a["accepted"], a["tokens"]) == \
               (b["request_id"], b["draft"], b["verified"], b["accepted"], b["tokens"])
        torch.testing.assert_close(torch.tensor(a["confidence"]), torch.tensor(b["confidence"]), atol=1e-4, rtol=1e-4)
    if mode.startswith("ngram"):
        assert sum(r["accepted"] for r in trace) > 0  # multi-row blocks were accepted, not only anchors


def test_sampling_at_one_token_per_step_equals_the_default_engine(tiny):
    """Temperature sampling without drafts draws from each request's generator exactly as the default
    engine does, and the static logits differ only in the last bits: the same tokens."""
    prompts = _prompts(5, seed=12)
    params = lambda i: SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i)  # noqa: E731
    default, _ = _staggered(tiny, prompts, params, 16)
    static, _ = _staggered(tiny, prompts, params, 16, static_decode=True)
    assert static == default


@pytest.mark.parametrize("drafter, budget_kib", [("ngram", 110), ("dspark", 120)])
def test_random_admit_finish_abort_preempt_never_leak_slots(tiny, drafter, budget_kib):
    """Random arrivals, aborts (waiting, prefilling and decoding requests), finishes and, with a tight
    state budget, preemptions: after every step the slots held are exactly the decoding requests'
    and are 0 .. n − 1 (with DSpark a preempted request re-prefills its draft state and loads it into
    its new slot). The budget lets up to 3 requests decode at once, so leaving requests are
    compacted by moves and steps run on buckets of 1, 2 and 3 slots."""
    drafter = _drafters(tiny)["dspark3"]["drafter"] if drafter == "dspark" else drafter
    engine = Engine(tiny, EngineConfig(max_running=3, max_waiting=6, prefill_chunk=5, draft_tokens=2, drafter=drafter,
                                       state_budget_bytes=budget_kib * 1024, page_bytes=1024, static_decode=True,
                                       **LIMITS))
    seen = _spy_slots(engine)
    preemptions, decoded = random_traffic(engine, steps=90, seed=3)
    assert engine.slots.free == engine.slots.slots and not engine.slots.holder_slots()
    assert preemptions > 0 and decoded > 0
    assert len(seen["moves"]) > 3 and seen["buckets"] == {1, 2, 3}


def _second_token_distribution(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """The target's exact distribution of the second generated token, Σ_x p(x | prompt) p(· | prompt, x)
    over first tokens x other than EOS, with P(first token = EOS: no second token) appended: fp64 [V + 1]."""
    vocab, n, eos = model.config.vocab_size, len(prompt) + 1, model.config.eos_token_id
    with torch.inference_mode():
        out = model(torch.tensor([t for x in range(vocab) for t in prompt + [x]]), [model.new_state() for _ in range(vocab)],
                    [n] * vocab)
        logits = out.logits.view(vocab, n, -1).double() / temperature  # [V, n, V]
    first = torch.softmax(logits[0, -2], -1)  # [V]
    stop = first[eos].clone()
    first[eos] = 0
    return torch.cat((first @ torch.softmax(logits[:, -1], -1), stop[None]))


def test_sampled_static_dspark_rounds_follow_the_target_distribution(tiny, no_dynamic_dspark_propose):
    """Mixed batches of sampled (T = 1 and T = 0.6, each request's drafts keyed by its seed) and greedy requests on one
    prompt: the second token (committed by the first verify round: an accepted draft or the
    correction) follows the target's exact marginal (χ² per temperature); greedy requests give the
    target's greedy tokens; the round accepts drafts often (so the drafts' q matters); slots free."""
    dsp = _drafters(tiny)["dspark3"]["drafter"]
    prompt, per_temperature = [5, 17, 99, 3], 640
    temperatures = [1.0, 0.6, 0.0, 1.0, 0.6]  # request i samples at temperatures[i % 5]
    engine = Engine(tiny, EngineConfig(max_running=64, max_waiting=2048, prefill_chunk=8, max_prompt_tokens=8,
                                       max_new_tokens=4, draft_tokens=3, drafter=dsp, static_decode=True, trace=True))
    n = per_temperature * 5 // 2
    for i in range(n):
        engine.add_request(prompt, SamplingParams(temperature=temperatures[i % 5], seed=i), 3, request_id=f"r{i}")
    no_dynamic_dspark_propose()
    tokens = {}
    while engine.has_work():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
    assert engine.slots.free == engine.slots.slots and len(tokens) == n
    first_rounds = [r for r in engine.take_trace() if r["round"] == 0 and r["temperature"] > 0]
    assert all(r["verified"] == 1 for r in first_rounds)  # max_new_tokens = 3: one draft fits round 0
    assert sum(r["accepted"] for r in first_rounds) > len(first_rounds) // 4
    greedy = dspark.generate(tiny, prompt, max_new_tokens=3).token_ids
    assert all(tokens[f"r{i}"] == greedy for i in range(2, n, 5))
    for temperature in (1.0, 0.6):
        p = _second_token_distribution(tiny, prompt, temperature)
        vocab = p.numel() - 1  # the last bin: the request stopped at its first token (EOS)
        second = [(tokens[f"r{i}"] + [vocab])[1] for i in range(n) if temperatures[i % 5] == temperature]
        counts = torch.bincount(torch.tensor(second), minlength=p.numel()).double()
        expected = p * len(second)
        big = expected >= 5  # the rest pooled into one bin
        observed = torch.cat((counts[big], counts[~big].sum()[None]))
        expected = torch.cat((expected[big], expected[~big].sum()[None]))
        assert chisquare(observed.numpy(), expected.numpy())[1] > 1e-3


@pytest.mark.parametrize("kind", ["dspark3", "mtp"])
def test_a_seeded_sampled_request_gives_the_same_tokens_in_any_batch(tiny, kind):
    """On the static slots a seeded sampled request's drafts hash its seed and positions
    (`dspark.kernels.slot_noise`) and its verification draws from its own generator, so its tokens are
    the same alone, in a batch of other sampled and greedy requests, and in another slot."""
    from dspark.draft import MtpDrafter

    drafter = _drafters(tiny)["dspark3"]["drafter"] if kind == "dspark3" else MtpDrafter(tiny)
    prompts = [[5, 6, 7, 8], [40, 41], [9, 9, 9], [100, 3, 77, 12, 6]]

    def run(batch):  # batch: [(prompt index, params)]; returns each request's tokens and trace records
        engine = Engine(tiny, EngineConfig(max_running=4, static_decode=True, draft_tokens=3 if kind == "dspark3" else 1,
                                           drafter=drafter, trace=True, **LIMITS))
        rids = [engine.add_request(prompts[i], params, 16, stop_token_ids=()) for i, params in batch]
        tokens = {rid: [] for rid in rids}
        while engine.has_work():
            for event in engine.step():
                tokens[event.request_id] += event.new_token_ids
        trace = engine.take_trace()
        return [tokens[rid] for rid in rids], [[r for r in trace if r["request_id"] == rid] for rid in rids]

    mine = SamplingParams(temperature=0.9, seed=1234)
    (alone,), (rounds,) = run([(0, mine)])
    assert len(alone) == 16 and sum(r["accepted"] for r in rounds) > 0  # drafted, verified, accepted
    others = [(1, SamplingParams(temperature=1.0, seed=5)), (2, SamplingParams()), (3, SamplingParams(temperature=0.7))]
    full, _ = run([*others, (0, mine)])
    pair, _ = run([(0, mine), *others[:1]])
    assert full[-1] == alone and pair[0] == alone  # the last slot of a full batch; slot 0 beside one other


@pytest.mark.parametrize("path", [dict(), dict(static_decode=True, overlap=False), dict(static_decode=True)])
def test_a_fixed_budget_drafts_only_the_slots_it_verifies(tiny, path, monkeypatch):
    """draft_tokens=2 on a γ=5 DSpark drafter, on the dynamic path, the static one and the static one
    with a round in flight: greedy tokens equal plain decoding's, and every backbone call of the drafter
    took 2 slots per block past the stages (its LM head ran 2 rows per request, not 5), so every
    round's drafts and confidences have 2 entries."""
    dsp = _drafters(tiny)["dspark3"]["drafter"]
    blocks, widths = dsp.model.blocks, []

    def spy(*args, **kwargs):
        out = blocks(*args, **kwargs)
        widths.append((out.base.shape[1], out.hidden.shape[1], out.hidden_pre.shape[1]))
        return out

    monkeypatch.setattr(dsp.model, "blocks", spy)
    prompts = _prompts(5, seed=13)
    greedy = lambda i: SamplingParams()  # noqa: E731
    plain, _ = _staggered(tiny, prompts, greedy, 16)
    tokens, trace = _staggered(tiny, prompts, greedy, 16, draft_tokens=2, drafter=dsp, **path)
    assert tokens == plain
    assert widths and set(widths) == {(2, 2, 2)}
    assert trace and all(len(r["draft"]) == len(r["confidence"]) == 2 and r["verified"] <= 2 for r in trace)
    assert sum(r["verified"] for r in trace) > 0
    if not path:
        outs = dspark.generate(tiny, prompts, max_new_tokens=16, draft_tokens=2, drafter=dsp)
        assert [o.token_ids for o in outs] == [plain[f"r{i}"] for i in range(len(prompts))]


def test_static_draft_runner_refuses_a_bad_n_draft(tiny):
    from dspark.engine.static_draft import StaticDraftRunner

    with pytest.raises(ValueError, match=r"n_draft must be None or an int in \[1, γ=5\], got 6"):
        StaticDraftRunner(_drafters(tiny)["dspark3"]["drafter"], slots=2, tokens=4, n_draft=6)


def test_static_draft_runner_refuses_a_draft_state_behind_its_target(tiny):
    """A slot's anchor position is its target length, so a draft state of another length is refused."""
    from dspark.engine.static_draft import StaticDraftRunner

    drafting = StaticDraftRunner(_drafters(tiny)["dspark3"]["drafter"], slots=2, tokens=4)
    with pytest.raises(RuntimeError, match="slot 1: the draft state holds 0 positions but the target 5"):
        drafting.load(1, drafting.static.drafter.new_state(), 5)


def test_static_decode_default_is_off_on_the_cpu(tiny):
    """None (auto) picks the static path only where graphs replay (CUDA, Triton MoE): on the CPU the
    default engine runs the dynamic path, and True still forces the static one."""
    assert EngineConfig().static_decode is None
    assert not static_by_default(tiny)
    engine = Engine(tiny, EngineConfig(max_running=2, **LIMITS))
    assert not engine.static and engine.runner is None
    forced = Engine(tiny, EngineConfig(max_running=2, static_decode=True, **LIMITS))
    assert forced.static and forced.runner is not None


def test_static_decode_is_validated(tiny):
    with pytest.raises(ValueError, match="static_decode must be None \\(auto\\) or a bool, got 1"):
        EngineConfig(static_decode=1)
    with pytest.raises(ValueError, match="static_context=64 needs static_decode=True or None"):
        EngineConfig(static_decode=False, static_context=64)
    with pytest.raises(ValueError, match="static_context must be None or an int >= 2, got 1"):
        EngineConfig(static_decode=True, static_context=1)
    engine = Engine(tiny, EngineConfig(max_running=2, static_decode=True, static_context=40, **LIMITS))
    with pytest.raises(ValueError, match="exceed static_context=40"):
        engine.add_request([1] * 30, SamplingParams(), 11)
    v41 = json.loads(resources.files("dspark.configs").joinpath("tiny-v41.json").read_text())
    with pytest.raises(ValueError, match="keep their tables in host memory"):
        Engine(dspark.init_model(v41, seed=0, engram_tables="host"),
               EngineConfig(max_running=2, static_decode=True, **LIMITS))



def test_static_decode_refuses_kernels_a_graph_cannot_hold():
    """flashinfer's attention plans on the host at every call: never the static path's default, and a
    clear error (not a failed capture) when static_decode=True asks for it."""
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    kernels = KernelConfig(sparse_attention="flashinfer")
    model = dspark.init_model(config, seed=0, kernels=kernels)
    assert not graph_capturable(kernels) and graph_capturable(KernelConfig.uniform("triton"))
    with pytest.raises(ValueError, match="sparse_attention='flashinfer'"):
        Engine(model, EngineConfig(max_running=2, static_decode=True, **LIMITS))
    # deep_gemm converts each weight at its first call (a host sync) and JIT-compiles: no graph either
    deep = KernelConfig(fused_moe="triton", moe_experts="deep_gemm", linear="deep_gemm")
    assert not graph_capturable(deep)
    with pytest.raises(ValueError, match="moe_experts='deep_gemm', linear='deep_gemm'|linear='deep_gemm', moe_experts"):
        Engine(dspark.init_model(config, seed=0, kernels=deep), EngineConfig(max_running=2, static_decode=True, **LIMITS))
    # w8a8 quantises dense expert weights at its first call (host syncs): no graph either
    w8a8 = KernelConfig(fused_moe="triton", moe_experts="w8a8")
    assert not graph_capturable(w8a8)


@pytest.mark.parametrize("prefill_mode", ["exact", "bounded_replay"])
@pytest.mark.parametrize("mode", ["none", "ngram3", "dspark_auto"])
def test_static_decode_equals_the_default_engine_v41(prefill_mode, mode):
    """The same for a DeepSeek-V4.1 target (`StaticDecoderV41`), after either prefill mode, with the
    KV cache's QAT rounding off (it would turn last-bit differences into whole FP8 steps)."""
    v41 = json.loads(resources.files("dspark.configs").joinpath("tiny-v41.json").read_text())
    model = dspark.init_model(v41, seed=0, prefill_mode=prefill_mode, cache_qat=False)
    config = {"none": dict(), "ngram3": dict(draft_tokens=3, drafter="ngram"),
              "dspark_auto": dict(draft_tokens="auto", drafter=DSparkDrafter(
                  model, DSparkConfig.for_target(model.config, dspark_markov_rank=16)).init_weights(3))}[mode]
    prompts = _prompts(5, seed=5)
    default, trace = _staggered(model, prompts, lambda i: SamplingParams(), 12, **config)
    static, static_trace = _staggered(model, prompts, lambda i: SamplingParams(), 12, static_decode=True, **config)
    assert static == default and len(default) == len(prompts) and len(static_trace) == len(trace)
    # "auto" keeps a round in flight on the static path, and its plain rounds (budget 0) draft nothing;
    # the default engine drafted a block there and accepted none of it. A round in flight drafts one
    # slot past its budget: the first slots of the default engine's block.
    assert [(r["draft"], r["accepted"]) for r in static_trace] == \
        [(r["draft"][:len(s["draft"])], r["accepted"]) for r, s in zip(trace, static_trace)]


def test_slot_table_keeps_held_slots_compact():
    """A release in the middle moves the last holder into the gap; releasing the last moves nothing."""
    table = SlotTable(4)
    assert [table.assign(r) for r in "abcd"] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="all 4 slots are taken"):
        table.assign("e")
    assert table.release("b") == SlotMove("d", 3, 1) and table.release("b") is None
    assert table.holder_slots() == {"a": 0, "d": 1, "c": 2} and table.free == 1
    assert table.release("c") is None and table.assign("e") == 2
    assert table.release("a") == SlotMove("e", 2, 0) and table.holder_slots() == {"e": 0, "d": 1}
    with pytest.raises(ValueError, match="already holds slot 1"):
        table.assign("d")
    assert [bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6] and buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    state = SlotState(slot=2, length=10)
    assert state.advance(4) == 10 and state.length == 14
    state.truncate(12)
    with pytest.raises(ValueError, match=r"truncate\(9\) outside \[10, 12\]"):
        state.truncate(9)


def test_runner_steps_the_longest_block_and_returns_ragged_rows(tiny):
    """Blocks of 3 and 1 tokens in slots 2 and 0 (slot 1 free) of a T = 4 runner: a 3-token step whose
    gathered rows (logits, streams, features) equal the dynamic ragged call's, in request order (the
    features gathered only without an observer, which takes every slot's rows); bad calls are named."""
    from types import SimpleNamespace

    from dspark.engine.static_runner import StaticRunner

    runner = StaticRunner(tiny, slots=3, max_context=64, tokens=4, capture_layers=(2,))
    g = torch.Generator().manual_seed(4)
    states, requests = [], []
    for slot, n in ((2, 9), (0, 17)):
        state = tiny.new_state()
        tiny(torch.randint(0, 256, (n,), generator=g), [state], [n])
        states.append(state)
        requests.append(SimpleNamespace(request_id=f"s{slot}", state=SlotState(slot, runner.load(slot, state))))
    blocks = [[5, 6, 7], [8]]
    dynamic = tiny(torch.tensor([5, 6, 7, 8]), states, [3, 1], capture_layers=(2,))
    seen = []
    out, offsets = runner.forward(requests, blocks,
                                  observe=lambda features, starts, ids: seen.append((features, starts, ids)))
    assert offsets == [0, 3] and [r.state.length for r in requests] == [12, 18]
    (features, starts, ids), = seen  # every slot's rows of the step, for the static drafter
    assert starts.tolist() == [17, 0, 9] and tuple(features[2].shape[:2]) == (3, 3)
    assert ids.tolist() == [[8, 0, 0], [0, 0, 0], [5, 6, 7]]  # the step's tokens (padding: 0)
    assert out.features == {}  # the observer took every slot's rows: no ragged gather
    pairs = ((out.logits, dynamic.logits), (out.hidden, dynamic.hidden),
             (features[2][[2, 2, 2, 0], [0, 1, 2, 0]], dynamic.features[2]))
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for req, block in zip(requests, blocks):  # roll back and step again without an observer: gathered
        req.state.truncate(req.state.length - len(block))
    again, _ = runner.forward(requests, blocks)
    torch.testing.assert_close(again.features[2], dynamic.features[2], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(again.logits, out.logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="at most 4"):
        runner.forward(requests, [[1] * 5, [1]])
    with pytest.raises(ValueError, match="slot 2 fed twice"):
        runner.forward([requests[0], requests[0]], [[1], [1]])
    with pytest.raises(ValueError, match="holds no static slot"):
        runner.forward([SimpleNamespace(request_id="x", state=states[0])], [[1]])
    with pytest.raises(ValueError, match=r"layers \[3\]"):
        runner.forward(requests, [[1], [1]], SimpleNamespace(capture_layers=(3,)))


def test_one_row_observes_are_deferred_to_one_observe_of_t_rows(tiny, monkeypatch):
    """A one-row step's rows are copied, not observed: the static drafter observes once per T such steps
    (or at a flush) over all T rows, and the context it then drafts from equals observing every row as it
    came (within fp32 rounding: the rows are computed in one call of T rows)."""
    from dspark.engine.static_draft import StaticDraftRunner

    drafter, tokens = _drafters(tiny)["dspark3"]["drafter"], 4
    deferred, direct = (StaticDraftRunner(drafter, slots=2, tokens=tokens) for _ in range(2))
    calls = []
    observe = deferred.static.observe
    monkeypatch.setattr(deferred.static, "observe",
                        lambda f, s: (calls.append(f[drafter.capture_layers[0]].shape[1]), observe(f, s))[1])
    g = torch.Generator().manual_seed(5)
    shape = (2, 1, tiny.config.hc_mult, tiny.config.hidden_size)
    first = torch.tensor([5, 9])
    for j in range(tokens + 2):
        features = {i: torch.randn(shape, generator=g) for i in drafter.capture_layers}
        deferred.observe(features, first + j)
        direct.static.observe(features, first + j)
    assert calls == [tokens] and deferred._pending == (2, 2)  # T rows observed at once; two wait
    deferred.flush()
    assert calls == [tokens, tokens] and deferred._pending is None
    anchors = first + tokens + 2  # each slot's next anchor: every row written is below it
    for a, b in zip(_draft_context(deferred, anchors), _draft_context(direct, anchors)):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    deferred.observe(features, anchors)  # a new run; a wider step flushes it first
    deferred.observe({i: f.expand(2, 3, *shape[2:]) for i, f in features.items()}, anchors + 1)
    assert calls == [tokens, tokens, tokens, 3]


def _draft_context(runner, anchors: torch.Tensor) -> list[torch.Tensor]:
    """Per drafter stage the context keys [S, W, d] slots 0 .. S − 1 draft from at `anchors`."""
    state = runner.static.state
    rows = state.context_index(anchors)  # [S, W]
    return [torch.where((rows >= 0)[..., None], pool[rows.clamp(min=0)], 0) for pool in state.pools()]

