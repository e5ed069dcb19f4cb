"""`step_index` (dspark/kernels/step_index.py) against its reference, and the static steps that use it.

On CPU the kernel runs under the Triton interpreter (conftest.py). The index tensors are integers:
kernel, reference and the torch builds of `StepIndex` must agree exactly, and so must the static
steps' logits with and without the op.
"""

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dspark
from dspark.kernels import KernelConfig, triton_available
from dspark.kernels import step_index as si  # the kernel, and the reference and layout it re-exports
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoder
from dspark.models.deepseek_v41.static_step import StaticDecoderV41

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Every kind, with overlap and without, causal entries and CSA pick columns, rates above T.
SEGMENTS = [(si.ROW, 1, 1, 0, 0, 0, 0, 0), (si.ROW, 1, 1, 200, 0, 0, 0, 0), (si.ROW, 4, 1, 0, 0, 0, 0, 0),
            (si.ROW, 8, 1, 200, 0, 0, 0, 0), (si.RING, 1, 1, 11, 0, 0, 0, 0), (si.RING, 1, 1, 19, 0, 0, 0, 0),
            (si.KEYS, 1, 8, 11, 8, 1, 0, 0), (si.KEYS, 1, 14, 11, 8, 1, 0, 0), (si.KEYS, 1, 32, 19, 8, 8, 24, 57),
            (si.PHASE, 1, 1, 4, 0, 0, 0, 0), (si.PHASE, 1, 1, 8, 0, 0, 0, 0), (si.POOL, 4, 8, 11, 1, 0, 0, 0),
            (si.POOL, 8, 8, 19, 0, 0, 0, 0), (si.ENTRY_ROW, 4, 1, 48, 0, 0, 0, 0), (si.ENTRY_ROW, 8, 1, 24, 0, 0, 0, 0),
            (si.ENTRY_OFFSET, 1, 1, 57, 24, 0, 0, 0), (si.VISIBLE, 1, 1, 4, 0, 0, 0, 0), (si.VISIBLE, 1, 1, 8, 0, 0, 0, 0)]


@pytest.mark.parametrize("n_slots,tokens", [(1, 1), (3, 4), (2, 3)])
def test_step_index_equals_reference_on_random_starts(n_slots, tokens, monkeypatch):
    """Every segment kind at random starts (0, small and near the capacity): the kernel's flat output
    equals the reference's, every element written (the buffer is pre-filled with a value no segment
    takes)."""
    segments = si.SegmentTable.build(SEGMENTS, DEVICE)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7777))
    g = torch.Generator().manual_seed(n_slots * 10 + tokens)
    for trial in range(3):
        starts = torch.randint(0, 96 - tokens, (n_slots,), generator=g)
        starts[0] = 0 if trial == 0 else starts[0]
        starts = starts.to(DEVICE)
        got = si.step_index(starts, segments, tokens=tokens)
        want = si.step_index_ref(starts, segments, tokens=tokens)
        assert got.shape == (segments.size(n_slots, tokens),) and (got != -7777).all()
        assert torch.equal(got, want), starts


def test_segment_table_rejects_bad_rows():
    with pytest.raises(ValueError, match="segment"):
        si.SegmentTable.build([(si.ROW, 0, 1, 0, 0, 0, 0, 0)], "cpu")
    with pytest.raises(ValueError, match="starts"):
        si.step_index_ref(torch.zeros(2, 1, dtype=torch.long), si.SegmentTable.build(SEGMENTS[:1], "cpu"), tokens=1)


def _steps(decoder, rounds):
    """Logits of a few steps of 2 slots from position 0 on (accepting 2, 1, 3 tokens per step)."""
    outs, starts = [], [0, 3]
    for r in range(rounds):
        ids = torch.tensor([[(7 * r + 3 * s + t) % 50 for t in range(3)] for s in range(2)])
        outs.append(decoder.step(*decoder.plan(ids, starts)))
        starts = [p + 1 + (r + s) % 3 for s, p in enumerate(starts)]
    return outs


@pytest.mark.parametrize("pool", ["ref", "triton"])
def test_v4_static_step_with_the_op_equals_the_torch_builds(pool):
    """tiny-v4 (CSA + HCA + SWA layers), 2 slots x 3 tokens: the step with `step_index` (every index a
    view of its output, RoPE rows in one gather) gives the logits of the step with the torch builds,
    bit for bit, with the fused compressor pool (its `pool_index` planned) and without."""
    logits = []
    for impl in ("ref", "triton"):
        kernels = KernelConfig(step_index=impl, compressor_pool_gather=pool)
        model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, kernels=kernels)
        logits.append(_steps(StaticDecoder(model, StaticShape(slots=2, max_context=48, tokens=3)), 3))
    for ref, fused in zip(*logits):
        assert torch.equal(ref, fused)


def test_v41_static_step_with_the_op_equals_the_torch_builds():
    """tiny-v41 shares `StepIndex` (no plan: the op makes its positions): same logits."""
    logits = []
    for impl in ("ref", "triton"):
        model = dspark.init_model("tiny-v41", seed=0, device=DEVICE, prefill_mode="exact", cache_qat=False,
                                  kernels=KernelConfig(step_index=impl))
        logits.append(_steps(StaticDecoderV41(model, StaticShape(slots=2, max_context=48, tokens=3)), 2))
    for ref, fused in zip(*logits):
        assert torch.equal(ref, fused)


class SiteOps(TorchDispatchMode):
    """Non-view torch ops by the innermost dspark function (as bench/graph_decode.py's `op_sites`)."""

    VIEWS = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "reshape", "select", "slice", "as_strided",
             "alias", "flatten", "detach", "empty", "empty_like", "empty_strided", "_reshape_alias"}

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.VIEWS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/dspark/" in f.filename]
            if frames:
                self.sites[f"{frames[-1].filename.split('/dspark/')[-1]}:{frames[-1].name}"] += 1
        return func(*args, **(kwargs or {}))


def test_a_v4_step_builds_its_indices_in_one_launch_and_one_gather(monkeypatch):
    """A tiny-v4 decode step (1 slot, 1 token) with the GPU's index path (`step_index`, fused pool):
    the position-derived tensors cost one `step_index` launch and one RoPE `index_select`; with the
    torch builds the same step dispatched 47 ops there (and `forward` an arange and an add)."""
    kernels = KernelConfig(step_index="triton", compressor_pool_gather="triton")
    model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, kernels=kernels)
    decoder = StaticDecoder(model, StaticShape(slots=1, max_context=64, tokens=1))
    ids, starts = decoder.plan([[1]], [40])
    decoder.step(ids, starts)
    launches = []
    op = decoder.index_tables.step_index_op
    monkeypatch.setattr(decoder.index_tables, "step_index_op", lambda *a, **k: launches.append(1) or op(*a, **k))
    with SiteOps() as counter:
        decoder.step(ids, starts)
    index_sites = {site: n for site, n in counter.sites.items()
                   if site.startswith(("models/deepseek_v4/static_index.py", "models/deepseek_v4/rope.py",
                                       "models/deepseek_v4/static_state.py:rows"))}
    assert index_sites == {"models/deepseek_v4/static_index.py:_gather_rope_rows": 1}, index_sites
    assert counter.sites["models/deepseek_v4/static_step.py:forward"] == 2  # embedding, clone: no arange, add
    assert launches == [1]
    # Nothing is built on first use, so a decoder may run side streams over this index (`side_stream.py`).
    assert StaticDecoder(model, StaticShape(slots=1, max_context=64, tokens=1), side_streams=2).side_streams == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_index_on_cuda_equals_reference_at_v4_mini_sizes():
    """The compiled kernel at v4-mini's segments (window 128, CSA 4 / HCA 128, C 4160) for 1 and 8
    slots of 1 and 4 tokens: equal to the reference."""
    segments = si.SegmentTable.build(
        [(si.ROW, 1, 1, 0, 0, 0, 0, 0), (si.ROW, 1, 1, 4160, 0, 0, 0, 0), (si.ROW, 4, 1, 4160, 0, 0, 0, 0),
         (si.ROW, 128, 1, 4160, 0, 0, 0, 0), (si.RING, 1, 1, 131, 0, 0, 0, 0), (si.RING, 1, 1, 11, 0, 0, 0, 0),
         (si.KEYS, 1, 128, 131, 128, 1, 0, 0), (si.KEYS, 1, 640, 131, 128, 1, 0, 0),
         (si.KEYS, 1, 160, 131, 128, 128, 32, 1048), (si.PHASE, 1, 1, 4, 0, 0, 0, 0), (si.PHASE, 1, 1, 128, 0, 0, 0, 0),
         (si.POOL, 4, 8, 11, 1, 0, 0, 0), (si.POOL, 128, 128, 131, 0, 0, 0, 0), (si.ENTRY_ROW, 4, 1, 1040, 0, 0, 0, 0),
         (si.ENTRY_ROW, 128, 1, 32, 0, 0, 0, 0), (si.ENTRY_OFFSET, 1, 1, 1048, 1040, 0, 0, 0),
         (si.VISIBLE, 1, 1, 4, 0, 0, 0, 0)], "cuda")
    g = torch.Generator().manual_seed(0)
    for n_slots, tokens in ((1, 1), (8, 4), (8, 1)):
        starts = torch.randint(0, 4156, (n_slots,), generator=g).cuda()
        assert torch.equal(si.step_index(starts, segments, tokens=tokens),
                           si.step_index_ref(starts, segments, tokens=tokens))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_static_steps_with_the_op_equal_the_torch_builds():
    """tiny-v4 and tiny-v41 on CUDA with every other op as `for_device` picks (Triton selection writing
    its picks into the op's CSA key list, fused pool reading its `pool_index`): the same logits, bit
    for bit, with `step_index` on Triton and on its reference (the torch builds)."""
    import dataclasses

    for name, decoder_cls, options in (("tiny-v4", StaticDecoder, {}),
                                       ("tiny-v41", StaticDecoderV41, dict(prefill_mode="exact", cache_qat=False,
                                                                           engram_tables="device"))):
        logits = []
        for impl in ("ref", "triton"):
            kernels = dataclasses.replace(KernelConfig.for_device("cuda"), step_index=impl)
            model = dspark.init_model(name, seed=0, device="cuda", kernels=kernels, **options)
            logits.append(_steps(decoder_cls(model, StaticShape(slots=2, max_context=48, tokens=3)), 3))
        for ref, fused in zip(*logits):
            assert torch.equal(ref, fused), name
