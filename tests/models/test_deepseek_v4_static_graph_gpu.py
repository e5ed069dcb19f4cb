"""The static decode step on the GPU: no host sync in the eager step, captured graphs (T = 1 and 4)
replayed on new inputs equal the eager step, and both follow the dynamic path (tiny-v4, fp32, the
Triton kernels of `KernelConfig.for_device("cuda")`)."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig
from dspark.models.deepseek_v4.static_step import StaticDecoder
from static_step_checks import check_graph_replay


@pytest.mark.gpu
@pytest.mark.parametrize("gather", [True, False])  # False: the step's former path (copied slots, torch scores)
@torch.no_grad()
def test_static_step_graph_replay_equals_eager_without_sync(gather):
    kernels = KernelConfig.for_device("cuda")
    if not gather:
        kernels = dataclasses.replace(kernels, compressor_pool_gather="ref", index_scores="ref")
    model = dspark.init_model("tiny-v4", seed=0, device="cuda", kernels=kernels)
    check_graph_replay(model, StaticDecoder)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["v4", "v41"])
@torch.no_grad()
def test_the_side_stream_runs_the_compressors_beside_and_changes_no_bit(family, monkeypatch):
    """`StaticDecoder(side_stream=True)` (the default) runs each layer's compressors (V4: both of a CSA
    layer, V4.1: a KV source's publishing) on a second stream, and its logits, eager and replayed
    from a graph, equal the single-stream decoder's bit for bit over verify and decode rounds."""
    from dspark.engine.graphs import StepGraph
    from dspark.models.deepseek_v4 import static_step
    from dspark.models.deepseek_v4.static_state import StaticShape
    from dspark.models.deepseek_v41 import static_step as static_step_v41

    if family == "v4":
        model = dspark.init_model("tiny-v4", seed=0, device="cuda", kernels=KernelConfig.for_device("cuda"))
        decoder_cls, module, branch = StaticDecoder, static_step, "update_compressor"
    else:
        model = dspark.init_model("tiny-v41", seed=0, device="cuda", prefill_mode="exact", cache_qat=False,
                                  engram_tables="device", kernels=KernelConfig.for_device("cuda"))
        decoder_cls, module, branch = static_step_v41.StaticDecoderV41, static_step_v41, "publish"
    streams = []
    work = getattr(module, branch)
    monkeypatch.setattr(module, branch, lambda *a, **k: streams.append(torch.cuda.current_stream()) or work(*a, **k))
    lengths = (5, 21)
    g = torch.Generator().manual_seed(1)
    decoders, graphs = [], []
    for side in (True, False):
        decoder = decoder_cls(model, StaticShape(slots=2, max_context=96, tokens=4), side_stream=side)
        graphs.append(StepGraph(decoder, 4))
        decoders.append(decoder)
    for slot, n in enumerate(lengths):
        state = model.new_state()
        model(torch.randint(0, 256, (n,), generator=g).cuda(), [state], [n])
        for decoder in decoders:
            decoder.load(slot, state)
    starts = torch.tensor(lengths)
    main = torch.cuda.current_stream()
    for round_ in range(6):
        ids, dev_starts = decoders[0].plan(torch.randint(0, 256, (2, 4), generator=g), starts)
        streams.clear()
        eager = [decoder.step(ids, dev_starts) for decoder in decoders]
        half = len(streams) // 2  # the side-stream decoder's calls, then the single-stream one's
        assert half and all(s != main for s in streams[:half]) and all(s == main for s in streams[half:])
        assert torch.equal(eager[0], eager[1])
        replayed = [graph.replay(ids, dev_starts).clone() for graph in graphs]
        assert torch.equal(replayed[0], replayed[1]) and torch.equal(replayed[0], eager[0])
        starts = starts + 1 + round_ % 4  # accept 1..4 of the 4 tokens fed
