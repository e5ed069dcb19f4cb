"""The static DSpark drafter on the GPU: no host sync in the eager observe / propose, captured graphs
replayed on new inputs equal the eager calls, and greedy drafts equal the dynamic drafter's
(tiny-v4, fp32, the Triton kernels of `KernelConfig.for_device("cuda")`, γ = 5)."""

import pytest
import torch
from scipy.stats import chisquare

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.static_context import StaticDraftShape
from dspark.draft.static_drafter import StaticDrafter
from dspark.draft.static_graph import ObserveGraph, ProposeGraph, SampledProposeGraph
from dspark.kernels import KernelConfig

GAMMA, LENGTHS = 5, (0, 5, 13, 30)


def no_sync(fn):
    """fn() with any host sync raising."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@torch.no_grad()
def test_static_draft_graphs_replay_equal_eager_without_sync():
    model = dspark.init_model("tiny-v4", seed=0, device="cuda", kernels=KernelConfig.for_device("cuda"))
    drafter = DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=32)).init_weights(3)
    n = len(LENGTHS)
    shape = StaticDraftShape(slots=n, tokens=GAMMA + 1)
    eager, graphed = StaticDrafter(drafter, shape), StaticDrafter(drafter, shape)
    observe = ObserveGraph(graphed, GAMMA + 1)  # before loading: its warm-up writes every slot
    propose = ProposeGraph(graphed, pool=observe.pool())
    g = torch.Generator().manual_seed(0)
    states, dstates, positions = [], [], []
    for slot, length in enumerate(LENGTHS):
        state, dstate = model.new_state(), drafter.new_state()
        if length:
            ids = torch.randint(0, 256, (length,), generator=g).cuda()
            out = model(ids, [state], [length], capture_layers=drafter.capture_layers)
            drafter.observe(dstate, ids, out.hidden, out.features)
        states.append(state)
        dstates.append(dstate)
        eager.load(slot, dstate)
        positions.append(graphed.load(slot, dstate))
    positions = torch.tensor(positions)
    anchors = torch.randint(0, 256, (n,), generator=g)
    for round_ in range(8):
        a, p, temps = eager.plan(anchors, positions, [1.0, 0.0, 0.7, 1.3])
        out = no_sync(lambda: eager.propose(a, p))
        sampled = no_sync(lambda: eager.propose(a, p, temps))  # slots' counter-based noise
        replayed = propose.replay(a, p)
        torch.cuda.synchronize()
        assert torch.equal(replayed.tokens, out.tokens)
        assert torch.equal(replayed.confidence, out.confidence)
        assert torch.equal(sampled.tokens[1], out.tokens[1])  # the greedy row of the sampled call
        dynamic = drafter.propose(dstates, anchors.tolist(), dspark.SamplingParams(), [torch.Generator()] * n)
        assert torch.equal(out.tokens, dynamic.tokens)
        torch.testing.assert_close(out.confidence_logits, dynamic.confidence_logits, atol=1e-3, rtol=1e-3)
        # verify round: commit the anchor and 0..γ drafts per slot
        block = torch.cat((anchors.cuda()[:, None], out.tokens), dim=1)  # [S, γ + 1]
        target = model(block.reshape(-1), states, [GAMMA + 1] * n, capture_layers=drafter.capture_layers)
        feats = {i: f.view(n, GAMMA + 1, *f.shape[1:]) for i, f in target.features.items()}
        kept = torch.randint(1, GAMMA + 2, (n,), generator=g)
        for b, (state, dstate, k) in enumerate(zip(states, dstates, kept.tolist())):
            drafter.observe(dstate, block[b, :k], None, {i: f[b, :k] for i, f in feats.items()})
            state.truncate(state.length - GAMMA - 1 + k)
        starts = p.clone()
        no_sync(lambda: eager.observe(feats, starts))
        observe.replay(feats, starts)
        positions = positions + kept
        anchors = torch.randint(0, 256, (n,), generator=g)


@pytest.mark.gpu
@torch.no_grad()
def test_sampled_propose_graph_draws_fresh_noise_from_q():
    """`SampledProposeGraph` (noise hashed from each slot's key, `dspark.kernels.slot_noise`): a replay
    draws what the eager sampled propose draws on the same state and keys, its greedy row is the greedy
    chain, and the replay reads the keys live: over 3000 replays with a new key each, the first drafted
    token of the T = 2 slot follows q (χ²; a graph that replayed its capture's noise would draw one token)."""
    model = dspark.init_model("tiny-v4", seed=0, device="cuda", dtype=torch.float32,
                              kernels=KernelConfig.for_device("cuda"))
    drafter = DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=32)).init_weights(3)
    static = StaticDrafter(drafter, StaticDraftShape(slots=2, tokens=GAMMA + 1))
    g = torch.Generator().manual_seed(4)
    positions = []
    for slot in range(2):
        state, dstate = model.new_state(), drafter.new_state()
        ids = torch.randint(0, 256, (9 + slot,), generator=g).cuda()
        out = model(ids, [state], [len(ids)], capture_layers=drafter.capture_layers)
        drafter.observe(dstate, ids, out.hidden, out.features)
        positions.append(static.load(slot, dstate))
    a, p, temps = static.plan(torch.randint(0, 256, (2,), generator=g), positions, [2.0, 0.0])
    graph = SampledProposeGraph(static.propose, 2, static.device)
    greedy = static.propose(a, p)
    n = 3000
    firsts = torch.empty(n, dtype=torch.long, device="cuda")
    for i in range(n):
        static.noise_keys[0] = i  # another request's key: other noise, read by the replay from the buffer
        out = graph.replay(a, p, temps)
        firsts[i] = out.tokens[0, 0]
    eager = static.propose(a, p, temps)  # the last key: the last replay's draw
    assert torch.equal(out.tokens, eager.tokens)
    assert torch.equal(out.probs[:, 0], eager.probs[:, 0])  # q of the first draft: the anchor's
    assert torch.equal(out.tokens[1], greedy.tokens[1])  # the greedy row
    q = out.probs[0, 0].double().cpu()
    counts = torch.bincount(firsts.cpu(), minlength=q.numel()).double()
    assert counts.count_nonzero() > 1
    keep = q * n >= 5  # the rest pooled into one bin (when it has mass)
    observed, expected = counts[keep], q[keep]
    if not keep.all():
        observed, expected = torch.cat((observed, counts[~keep].sum()[None])), torch.cat((expected, q[~keep].sum()[None]))
    assert chisquare(observed.numpy(), (expected / expected.sum() * n).numpy())[1] > 1e-3


def _fp32_pair():
    """tiny-v4 in fp32 on CUDA with its fused kernels, and a random DSpark drafter (Markov rank 32)."""
    model = dspark.init_model("tiny-v4", seed=0, device="cuda", dtype=torch.float32,
                              kernels=KernelConfig.for_device("cuda"))
    return model, DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=32)).init_weights(3)


def _load_requests(model, drafter, statics, g) -> list[int]:
    """One request of each length in LENGTHS (random ids, observed by the dynamic drafter) loaded into
    slot i of every static drafter in `statics`; returns the positions of their next anchors."""
    positions = []
    for slot, length in enumerate(LENGTHS):
        dstate = drafter.new_state()
        if length:
            ids = torch.randint(0, 256, (length,), generator=g).cuda()
            out = model(ids, [model.new_state()], [length], capture_layers=drafter.capture_layers)
            drafter.observe(dstate, ids, out.hidden, out.features)
        positions.append([static.load(slot, dstate) for static in statics][-1])
    return positions


@pytest.mark.gpu
@torch.no_grad()
def test_trimmed_propose_graphs_hold_the_first_slots_of_the_full_block():
    """A static drafter built for n_draft = 2 captures graphs of 2 slots: greedy and sampled replays
    give [S, 2] proposals, the greedy one the first 2 slots of the full drafter's tokens (fp32 here;
    in bf16 the LM head's GEMM over fewer rows may round differently, so an argmax tie could flip)."""
    model, drafter = _fp32_pair()
    shape = StaticDraftShape(slots=len(LENGTHS), tokens=GAMMA + 1)
    full, trimmed = StaticDrafter(drafter, shape), StaticDrafter(drafter, shape, n_draft=2)
    g = torch.Generator().manual_seed(5)
    positions = _load_requests(model, drafter, (full, trimmed), g)
    a, p, temps = trimmed.plan(torch.randint(0, 256, (len(LENGTHS),), generator=g), positions, [1.0, 0.0, 0.7, 1.3])
    greedy = ProposeGraph(trimmed).replay(a, p)
    sampled = SampledProposeGraph(trimmed.propose, len(LENGTHS), trimmed.device).replay(a, p, temps)
    torch.cuda.synchronize()
    assert greedy.tokens.shape == sampled.tokens.shape == (len(LENGTHS), 2)
    assert sampled.probs.shape[:2] == (len(LENGTHS), 2)
    assert torch.equal(greedy.tokens, full.propose(a, p).tokens[:, :2])
    assert torch.equal(sampled.tokens[1], greedy.tokens[1])  # the greedy row of the sampled graph


@pytest.mark.gpu
@torch.no_grad()
def test_narrower_propose_graphs_of_one_runner_hold_the_first_slots():
    """A runner with `narrower` graphs (auto's round in flight drafts n, or n + 1 on a probe round)
    replays each width w = 1 .. γ − 1 from its own graph: the first w tokens and confidences of the
    full width's."""
    from dspark.engine.slots import buckets
    from dspark.engine.static_draft import StaticDraftRunner

    model, drafter = _fp32_pair()
    runner = StaticDraftRunner(drafter, len(LENGTHS), GAMMA + 1, narrower=True)
    b = len(LENGTHS)
    assert sorted(runner.propose_graphs) == [(s, w) for s in buckets(b) for w in range(1, GAMMA + 1)]
    g = torch.Generator().manual_seed(6)
    positions = _load_requests(model, drafter, (runner.static,), g)
    a, p, _ = runner.static.plan(torch.randint(0, 256, (b,), generator=g), positions, None)
    full = runner.propose(a, p)
    tokens, conf = full.tokens.clone(), full.confidence.clone()
    for w in range(1, GAMMA):
        narrow = runner.propose(a, p, w)
        torch.cuda.synchronize()
        assert narrow.tokens.shape == (b, w)
        assert torch.equal(narrow.tokens, tokens[:, :w])
        torch.testing.assert_close(narrow.confidence, conf[:, :w], rtol=1e-5, atol=1e-6)
