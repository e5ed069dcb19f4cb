"""`StepIndex` / `StepTables` (static_index.py) and `RopeTable` (rope.py): the same values as the plain
formulas, in few torch ops per step (each op is about one kernel launch of a CUDA-graph step).

tiny-v4 (CPU, fp32): two RoPE groups (main; compress with YaRN), window 8, CSA rate 4, HCA rate 8.
"""

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dspark
from dspark.models.deepseek_v4.rope import RopeTable
from dspark.models.deepseek_v4.static_index import StepIndex, StepTables
from dspark.models.deepseek_v4.static_state import PositionRing, StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoder

# Ops that only make views or metadata (no kernel), as bench/graph_decode.py's `op_sites` leaves out.
VIEWS = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "reshape", "select", "slice", "as_strided",
         "alias", "flatten", "detach", "empty", "empty_like", "empty_strided", "_reshape_alias"}
INDEX_FILES = ("deepseek_v4/static_index.py", "deepseek_v4/rope.py")  # and `PositionRing.rows`


def is_index_site(frame) -> bool:
    return frame.filename.endswith(INDEX_FILES) or (frame.filename.endswith("static_state.py") and frame.name == "rows")


class SiteOps(TorchDispatchMode):
    """Counts the non-view torch ops dispatched from the index builds (`is_index_site` of the innermost
    dspark frame)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/dspark/" in f.filename]
            if frames and is_index_site(frames[-1]):
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model():
    return dspark.init_model("tiny-v4", seed=0)


def test_rope_table_rows_equal_cos_sin_bit_for_bit(model):
    """Every position's table row is `Rope.cos_sin` of it, whether computed alone or in a batch."""
    length = 300
    ropes = {id(layer.attn.rope): layer.attn.rope for layer in model.layers}.values()
    assert len({(r.inv_freq.sum().item(), r.attention_factor) for r in ropes}) == 2  # main and YaRN compress
    for rope in ropes:
        table = RopeTable(rope, length)
        positions = torch.arange(length)
        cos, sin = table.cos_sin(positions.view(20, 15))
        ref_cos, ref_sin = rope.cos_sin(positions.view(20, 15))
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin) and cos.is_contiguous()
        for p in (0, 1, 7, 64, 131, length - 1):
            one_cos, one_sin = rope.cos_sin(torch.tensor([p]))
            assert torch.equal(table.cos_sin(torch.tensor([p]))[0], one_cos)
            assert torch.equal(table.cos_sin(torch.tensor([p]))[1], one_sin)


def reference(positions: torch.Tensor, ring_size: int, window: int, rate: int, n_entries: int, first: int):
    """The plain formulas of the index tensors (static_index.py's docstrings), built with fresh ops."""
    s, t = positions.shape
    slot = torch.arange(s).unsqueeze(-1)  # [S, 1]
    keys = positions.unsqueeze(-1) - window + 1 + torch.arange(window)
    window_keys = torch.where(keys >= 0, slot.unsqueeze(-1) * ring_size + keys % ring_size, -1).flatten(0, 1)
    w = positions[:, :1] // rate + torch.arange(-(-t // rate))
    complete = (w + 1) * rate <= positions[:, -1:] + 1
    entry_rows = (torch.where(complete, w, n_entries) + slot * (n_entries + 1)).reshape(-1)
    pos = w.unsqueeze(-1) * rate + torch.arange(-rate, rate)  # overlap: groups w − 1 and w
    half = (torch.arange(-rate, rate) >= 0).long()
    pool = torch.where(pos < 0, -1, (slot.unsqueeze(-1) * ring_size + pos.clamp(min=0) % ring_size) * 2 + half)
    offsets = (first + slot * (n_entries + 1)).expand(s, t).reshape(-1, 1)
    visible = (positions + 1) // rate
    causal = torch.where(torch.arange(n_entries) < visible.reshape(-1, 1), torch.arange(n_entries) + offsets, -1)
    return dict(window_keys=window_keys, entry_rows=entry_rows, pool_index=pool.flatten(0, 1),
                entry_offsets=offsets, causal_entries=causal, group_starts=(w * rate).reshape(-1), visible=visible)


def built(index: StepIndex, ring: PositionRing) -> dict:
    """What `reference` computes, from `index` (window 8, CSA-like rate 4 with overlap, E 24, first 33)."""
    return dict(window_keys=index.window_keys(8, ring), entry_rows=index.entry_rows(4, 24),
                pool_index=index.pool_index(4, True, ring), entry_offsets=index.entry_offsets(33, 24),
                causal_entries=index.causal_entries(4, 24, 33), group_starts=index.group_starts(4),
                visible=index.visible(4))


@pytest.mark.parametrize("starts,tokens", [([0, 5, 17], 4), ([3, 90, 40], 1), ([0, 1], 3), ([61, 7], 4)])
def test_step_index_equals_the_plain_formulas(model, starts, tokens):
    """Window keys, entry rows, pool indices, entry offsets, causal entries of buckets of 1..3 slots and
    1..4 tokens: equal to the formulas, −1 exactly where nothing is visible."""
    tables = StepTables(model, StaticShape(slots=3, max_context=96, tokens=4))
    positions = torch.tensor(starts).unsqueeze(-1) + torch.arange(tokens)
    ring = PositionRing(torch.zeros(3, 11, 2))
    index = StepIndex(torch.tensor(starts), tokens, tables)
    assert torch.equal(index.positions, positions)
    ref = reference(positions, ring.size, window=8, rate=4, n_entries=24, first=33)
    got = built(index, ring)
    for name, value in ref.items():
        assert torch.equal(got[name], value), name
    rows, half, missing = index.group_rows(8, False, ring)  # HCA: m rows, nothing missing
    assert torch.equal(index.pool_index(8, False, ring), rows.flatten(0, 1)) and not missing.any()
    assert torch.equal(rows, ring.rows(index.group_starts(8).view(len(starts), -1, 1) + torch.arange(8)))
    assert not half.any() and missing.shape == (*rows.shape, 1)


def test_hca_layers_share_one_key_list(model):
    """The HCA key list [window | causal entries] is built once per step (every HCA layer gets the same
    tensor)."""
    tables = StepTables(model, StaticShape(slots=3, max_context=96, tokens=4))
    ring = PositionRing(torch.zeros(3, 11, 2))
    index = StepIndex(torch.tensor([0, 5, 17]), 4, tables)
    keys = index.hca_keys(8, ring, 4, 24, 33)
    assert index.hca_keys(8, ring, 4, 24, 33) is keys
    assert torch.equal(keys, torch.cat((index.window_keys(8, ring), index.causal_entries(4, 24, 33)), dim=-1))


def test_step_tables_reject_a_range_beyond_their_span(model):
    tables = StepTables(model, StaticShape(slots=2, max_context=32, tokens=2))
    assert torch.equal(tables.arange(-3, 2), torch.arange(-3, 2))
    with pytest.raises(ValueError, match=r"arange\(0, 1000\)"):
        tables.arange(0, 1000)
    with pytest.raises(ValueError, match="shape must be a StaticShape"):
        StepTables(model, (2, 32, 2))


def test_a_step_builds_its_indices_in_few_ops(model):
    """One tiny-v4 step (2 slots × 2 tokens, 2 RoPE groups, CSA + HCA layers): its position-derived
    tensors take at most 48 torch ops (105 before the tables: per call six RoPE ops, aranges and
    `torch.where` scalars), with no arange, scalar_tensor, cos or sin left in the step."""
    decoder = StaticDecoder(model, StaticShape(slots=2, max_context=64, tokens=2))
    ids, starts = decoder.plan([[1, 2], [3, 4]], [0, 5])
    decoder.step(ids, starts)
    with SiteOps() as counter:
        decoder.step(ids, starts)
    total = sum(counter.ops.values())
    assert 0 < total <= 48, counter.ops
    assert not {"arange", "scalar_tensor", "cos", "sin"} & set(counter.ops), counter.ops
    assert counter.ops["index_select"] == 4  # cos / sin of the rows and of the group starts, per group


@pytest.mark.gpu
def test_rope_table_and_indices_on_cuda():
    """On the GPU too: table rows equal `Rope.cos_sin` bit for bit over a V4-sized context (the
    table is computed in one batch, a step's rows in small ones), and the indices equal the formulas."""
    cuda = torch.device("cuda")
    model = dspark.init_model("tiny-v4", seed=0, device=cuda)
    for rope in {id(layer.attn.rope): layer.attn.rope for layer in model.layers}.values():
        table = RopeTable(rope, 8192)
        for positions in (torch.arange(8192, device=cuda), torch.tensor([0, 4095, 8191], device=cuda)):
            cos, sin = table.cos_sin(positions)
            ref_cos, ref_sin = rope.cos_sin(positions)
            assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    tables = StepTables(model, StaticShape(slots=3, max_context=96, tokens=4))
    ring = PositionRing(torch.zeros(3, 11, 2, device=cuda))
    for starts, tokens in (([0, 5, 17], 4), ([3, 90, 40], 1)):
        positions = torch.tensor(starts).unsqueeze(-1) + torch.arange(tokens)
        index = StepIndex(torch.tensor(starts, device=cuda), tokens, tables)
        got = built(index, ring)
        for name, value in reference(positions, ring.size, window=8, rate=4, n_entries=24, first=33).items():
            assert torch.equal(got[name].cpu(), value), name
