"""The V4.1 static decode step on the GPU: no host sync in the eager step, captured graphs (T = 1,
and T = 4 also returning layers 4-6's input streams) replayed on new inputs equal the eager step,
and both follow the dynamic path (tiny-v41, fp32, exact prefill, no cache QAT, device Engram
tables, the Triton kernels of `KernelConfig.for_device("cuda")`)."""

import pytest
import torch

import dspark
from dspark.engine.graphs import StepGraph
from dspark.kernels import KernelConfig
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v41.static_step import StaticDecoderV41

SLOTS, LENGTHS, CAPTURE = 4, (3, 9, 17, 30), (4, 5, 6)


@pytest.mark.gpu
@torch.no_grad()
def test_static_v41_graph_replay_equals_eager_without_sync():
    model = dspark.init_model("tiny-v41", seed=0, device="cuda", prefill_mode="exact", cache_qat=False,
                              engram_tables="device", kernels=KernelConfig.for_device("cuda"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in LENGTHS]
    eager = StaticDecoderV41(model, StaticShape(slots=SLOTS, max_context=160, tokens=4))
    graphed = StaticDecoderV41(model, StaticShape(slots=SLOTS, max_context=160, tokens=4))
    graphs = {1: StepGraph(graphed, 1)}  # captured before any request is loaded (the warm-up writes)
    graphs[4] = StepGraph(graphed, 4, pool=graphs[1].pool(), capture_layers=CAPTURE)  # + the drafter's features
    states = []
    for slot, prompt in enumerate(prompts):
        state = model.new_state()
        model(prompt.cuda(), [state], [len(prompt)])
        states.append(state)
        eager.load(slot, state)
        graphed.load(slot, state)
    starts = torch.tensor(LENGTHS)
    for round_ in range(12):
        tokens = 1 if round_ % 2 else 4
        ids, dev_starts = eager.plan(torch.randint(0, 256, (SLOTS, tokens), generator=g), starts)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager_out = eager.forward(ids, dev_starts, CAPTURE if tokens == 4 else ())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out = eager_out.logits
        replayed = graphs[tokens].replay(ids, dev_starts)
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
        for i, features in eager_out.features.items():
            assert torch.equal(graphs[tokens].output.features[i], features)
        dynamic = model(ids.reshape(-1), states, [tokens] * SLOTS).logits.view(SLOTS, tokens, -1)
        torch.testing.assert_close(out, dynamic, atol=1e-3, rtol=1e-3)
        accept = torch.randint(1, tokens + 1, (SLOTS,), generator=g)
        for state, n in zip(states, accept.tolist()):
            state.truncate(state.length - tokens + n)
        starts = starts + accept
