"""Checks shared by the V4 and V4.1 static-step tests (test_deepseek_v4_static_step.py,
tests/models_v41/test_deepseek_v41_static_step.py): each passes its model and decoder class."""

import pytest
import torch

from dspark.models.deepseek_v4.moe import MoE
from dspark.models.deepseek_v4.static_state import StaticShape

TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture
def row_independent_moe(monkeypatch):
    """The reference MoE runs each expert on the rows routed to it, so a row's matmul sums depend on
    which other rows share its experts (last-bit differences). For the bit-for-bit checks, run it one
    row at a time (same formula); the Triton decode path is per row anyway."""
    reference = MoE.forward_ref

    def per_row(self, x, input_ids):
        return torch.cat([reference(self, x[i : i + 1], input_ids[i : i + 1]) for i in range(x.shape[0])])

    monkeypatch.setattr(MoE, "forward_ref", per_row)


def prefilled(model, decoder, lengths, seed):
    """Prefill one random prompt per slot on the dynamic path, load each into its slot.
    Returns (the dynamic states, their lengths = the slots' start positions [S])."""
    g = torch.Generator().manual_seed(seed)
    states, starts = [], []
    for slot, n in enumerate(lengths):
        state = model.new_state()
        if n:
            model(torch.randint(0, 256, (n,), generator=g), [state], [n])
        states.append(state)
        starts.append(decoder.load(slot, state))
    return states, torch.tensor(starts)


def run_rounds(decoder_cls, model, rejected, rounds=4):
    """Verify rounds of 4 tokens per slot accepting 2, then 4 more from there: returns each round's
    logits [S, 4, V] of the tokens fed after the rollback. `rejected` [rounds, S, 2]: the tokens
    rolled back each round (None: never fed)."""
    decoder = decoder_cls(model, StaticShape(slots=2, max_context=64, tokens=4))
    _, starts = prefilled(model, decoder, [7, 14], seed=4)
    g = torch.Generator().manual_seed(5)
    outs = []
    for r in range(rounds):
        accepted, following = torch.randint(0, 256, (2, 2), generator=g), torch.randint(0, 256, (2, 4), generator=g)
        if rejected is None:  # never sees them: the accepted tokens alone
            decoder.step(*decoder.plan(accepted, starts))
        else:
            decoder.step(*decoder.plan(torch.cat((accepted, rejected[r]), dim=1), starts))
        starts = starts + 2  # rollback: the two rejected positions are simply fed again
        outs.append(decoder.step(*decoder.plan(following, starts)))
        starts = starts + 4
    return outs


def check_rollback(decoder_cls, model):
    """Two runs that reject different tokens give bit-identical logits afterwards; both equal (to fp32
    tolerance: another row count changes the matmuls' sums) a run that never fed the rejected tokens."""
    g = torch.Generator().manual_seed(6)
    first = run_rounds(decoder_cls, model, torch.randint(0, 256, (4, 2, 2), generator=g))
    second = run_rounds(decoder_cls, model, torch.randint(0, 256, (4, 2, 2), generator=g))
    never = run_rounds(decoder_cls, model, None)
    for a, b, c in zip(first, second, never):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, **TOL)


def check_unused_slot(decoder_cls, model):
    """Slot 1 holds no request and is fed junk at position 0 or elsewhere: slots 0 and 2 are unchanged."""
    outs = []
    for junk_id, junk_start in ((0, 0), (123, 40)):
        decoder = decoder_cls(model, StaticShape(slots=3, max_context=64, tokens=2))
        _, starts = prefilled(model, decoder, [11, 0, 19], seed=7)
        starts[1] = junk_start
        g = torch.Generator().manual_seed(8)
        rounds = []
        for _ in range(6):
            ids = torch.randint(0, 256, (3, 2), generator=g)
            ids[1] = junk_id
            rounds.append(decoder.step(*decoder.plan(ids, starts))[[0, 2]])
            starts = starts + 2
        outs.append(torch.stack(rounds))
    assert torch.equal(outs[0], outs[1])


def check_bad_inputs(decoder):
    """The host checks every static decoder shares (`StaticDecoderBase`): a decoder of 2 slots,
    capacity 32, 4 tokens per step, over a model of 258 tokens."""
    ids, starts = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids must be a long \[b<=2, T<=4\].*\(3, 4\)"):
        decoder.step(torch.zeros(3, 4, dtype=torch.long), starts)
    with pytest.raises(ValueError, match=r"starts must be a long \[b=1\] tensor, got \(2,\)"):
        decoder.step(torch.zeros(1, 4, dtype=torch.long), starts)  # a bucket of 1 slot takes 1 start
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        decoder.plan(torch.zeros(2, 5, dtype=torch.long), starts)
    with pytest.raises(ValueError, match="starts must be a long"):
        decoder.step(ids, torch.zeros(2))
    with pytest.raises(ValueError, match=r"starts\[1\]=29: positions 29..32 outside the capacity"):
        decoder.plan(ids, [0, 29])
    with pytest.raises(ValueError, match=r"starts\[0\]=-1"):
        decoder.plan(ids, [-1, 0])
    with pytest.raises(ValueError, match=r"input_ids\[1, 2\]=258 outside \[0, 258\)"):
        decoder.plan([[0, 0, 0, 0], [0, 0, 258, 0]], [0, 0])
    with pytest.raises(ValueError, match="slot=2"):
        decoder.load(2, decoder.model.new_state())


def check_graph_replay(model, decoder_cls, capture=(), lengths=(3, 9, 17, 30), dynamic_tol=1e-3):
    """On the GPU: 12 rounds alternating T = 4 (also returning `capture`'s input streams) and T = 1 over
    one slot per prompt length. The eager step runs under sync-debug "error" (no host sync); graph
    replays on the same inputs equal it bit for bit (logits and features); both follow the dynamic
    path to `dynamic_tol` (None: not compared); each round accepts a random 1..T tokens."""
    from dspark.engine.graphs import StepGraph

    slots = len(lengths)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    eager = decoder_cls(model, StaticShape(slots=slots, max_context=160, tokens=4))
    graphed = decoder_cls(model, StaticShape(slots=slots, max_context=160, tokens=4))
    graphs = {1: StepGraph(graphed, 1)}  # captured before any request is loaded (the warm-up writes)
    graphs[4] = StepGraph(graphed, 4, pool=graphs[1].pool(), capture_layers=capture)  # + a drafter's features
    states = []
    for slot, prompt in enumerate(prompts):
        state = model.new_state()
        model(prompt.cuda(), [state], [len(prompt)])
        states.append(state)
        eager.load(slot, state)
        graphed.load(slot, state)
    starts = torch.tensor(lengths)
    for round_ in range(12):
        tokens = 1 if round_ % 2 else 4
        ids, dev_starts = eager.plan(torch.randint(0, 256, (slots, tokens), generator=g), starts)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager_out = eager.forward(ids, dev_starts, capture if tokens == 4 else ())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        replayed = graphs[tokens].replay(ids, dev_starts)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager_out.logits)
        for i, features in eager_out.features.items():
            assert torch.equal(graphs[tokens].output.features[i], features)
        dynamic = model(ids.reshape(-1), states, [tokens] * slots).logits.view(slots, tokens, -1)
        if dynamic_tol is not None:
            torch.testing.assert_close(eager_out.logits, dynamic, atol=dynamic_tol, rtol=dynamic_tol)
        accept = torch.randint(1, tokens + 1, (slots,), generator=g)
        for state, n in zip(states, accept.tolist()):
            state.truncate(state.length - tokens + n)
        starts = starts + accept


def check_head_weights_early(decoder_cls, model, monkeypatch):
    """`side_stream.HEAD_WEIGHTS_EARLY`: every indexer's head weights are made before its layer's c_q (on the
    KV lane, before it waits for c_q) and the verify rounds' logits are the same bits as with it off."""
    from dspark.models.deepseek_v4 import side_stream

    order = []
    for layer in model.layers:
        attn = layer.attn
        if getattr(attn, "indexer", None) is not None:
            indexer, project_q_lora = attn.indexer, attn.project_q_lora
            monkeypatch.setattr(indexer, "weights_op",
                                lambda *a, op=indexer.weights_op, **kw: order.append("weights") or op(*a, **kw))
            monkeypatch.setattr(attn, "project_q_lora", lambda x, f=project_q_lora: order.append("c_q") or f(x))
    shipped = run_rounds(decoder_cls, model, None, rounds=2)  # the prefill's dynamic path, then static steps
    assert order and set(zip(order[::2], order[1::2])) == {("c_q", "weights")}
    order.clear()
    monkeypatch.setattr(side_stream, "HEAD_WEIGHTS_EARLY", True)
    early = run_rounds(decoder_cls, model, None, rounds=2)
    assert set(zip(order[::2], order[1::2])) == {("c_q", "weights"), ("weights", "c_q")}  # static: weights first
    assert all(torch.equal(a, b) for a, b in zip(early, shipped))
