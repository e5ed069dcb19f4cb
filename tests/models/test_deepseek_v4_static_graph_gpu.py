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
@pytest.mark.parametrize("family,n_tok", [("v4", 2), ("v4", 4), ("v41", 4)])
@torch.no_grad()
def test_the_side_streams_run_beside_and_change_no_bit(family, n_tok, monkeypatch):
    """`StaticDecoder(side_streams=2)` runs each layer's compressors (V4: both of a CSA layer; V4.1: a
    KV source's publishing) on one side stream and its kv projection and indexer queries on another
    (with 3: every mHC site's mixes on a third; V4's norm-folded sites up to 4 rows, here 2 slots × 2
    tokens, and its unfolded ones, 2 × 4), and its logits, eager and replayed from a graph, equal the
    2-, 1-lane and single-stream decoders' bit for bit over verify and decode rounds."""
    from dspark.engine.graphs import StepGraph
    from dspark.models.deepseek_v4 import side_stream, static_step
    from dspark.models.deepseek_v4.static_state import StaticShape
    from dspark.models.deepseek_v41 import static_step as static_step_v41

    if family == "v4":
        model = dspark.init_model("tiny-v4", seed=0, device="cuda", kernels=KernelConfig.for_device("cuda"))
        decoder_cls, module, branch = StaticDecoder, static_step, "update_compressor"
    else:
        model = dspark.init_model("tiny-v41", seed=0, device="cuda", prefill_mode="exact", cache_qat=False,
                                  engram_tables="device", kernels=KernelConfig.for_device("cuda"))
        decoder_cls, module, branch = static_step_v41.StaticDecoderV41, static_step_v41, "publish"
    seen = []  # (which part, the stream it ran on): compressors on lane 0, the kv projection and the
    # indexer's queries on lane 1, each on the step's own stream where the decoder has fewer lanes
    work = getattr(module, branch)
    monkeypatch.setattr(module, branch, lambda *a, **k: seen.append(("compress", torch.cuda.current_stream()))
                        or work(*a, **k))
    indexer = next(layer.attn.indexer for layer in model.layers if layer.attn.indexer is not None)
    for owner, name, kind in ((type(model.layers[0].attn), "project_kv", "kv"), (type(indexer), "queries", "queries")):
        monkeypatch.setattr(owner, name, lambda *a, f=getattr(owner, name), kind=kind, **k:
                            seen.append((kind, torch.cuda.current_stream())) or f(*a, **k))
    lengths = (5, 21)
    g = torch.Generator().manual_seed(1)
    forks = []  # the lanes forked onto
    fork = side_stream.SideStreams.fork
    monkeypatch.setattr(side_stream.SideStreams, "fork", lambda self, lane: forks.append(lane) or fork(self, lane))
    decoders = [decoder_cls(model, StaticShape(slots=2, max_context=96, tokens=n_tok), side_streams=n)
                for n in (3, 2, 1, 0)]
    graphs = [StepGraph(decoder, n_tok) for decoder in decoders]
    for slot, n in enumerate(lengths):
        state = model.new_state()
        model(torch.randint(0, 256, (n,), generator=g).cuda(), [state], [n])
        for decoder in decoders:
            decoder.load(slot, state)
    starts = torch.tensor(lengths)
    main = torch.cuda.current_stream()
    for round_ in range(6):
        ids, dev_starts = decoders[0].plan(torch.randint(0, 256, (2, n_tok), generator=g), starts)
        eager = []
        for decoder in decoders:
            seen.clear()
            forks.clear()
            eager.append(decoder.step(ids, dev_starts))
            # 2 sites per layer, each with its mixes on the MIX lane where the decoder has one
            n_mixes = 2 * len(model.layers) if len(decoder.side.streams) > side_stream.MIX else 0
            assert forks.count(side_stream.MIX) == n_mixes
            lanes = [s for s in decoder.side.streams]
            kinds = {kind for kind, _ in seen}
            assert kinds == {"compress", "kv", "queries"}
            for kind, stream in seen:
                lane = 0 if kind == "compress" else 1
                assert stream == (lanes[lane] if lane < len(lanes) else main), (len(lanes), kind)
        assert all(torch.equal(eager[0], other) for other in eager[1:])
        replayed = [graph.replay(ids, dev_starts).clone() for graph in graphs]
        assert all(torch.equal(r, eager[0]) for r in replayed)
        starts = starts + 1 + round_ % n_tok  # accept 1..n_tok of the tokens fed
