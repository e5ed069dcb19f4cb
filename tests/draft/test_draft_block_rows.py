"""`BlockRows`: the DSpark stages of one `blocks` call share their RoPE rows and own-block pool rows."""

import pytest
import torch

import dspark
from dspark.draft import DSparkDrafter
from dspark.draft.stages import BlockRows
from dspark.models.deepseek_v4.rope import Rope


@pytest.mark.parametrize("target", ["tiny-v4", "tiny-v41"])
def test_stages_build_rope_and_block_rows_once_with_the_same_output(target, monkeypatch):
    """Three stages, one cos / sin and one own-block index per call (they were built per stage); the
    stages share one Rope module (equal tables) and the block output equals the stages run with rows
    built each on its own, bit for bit."""
    model = dspark.init_model(target, seed=0)
    drafter = DSparkDrafter(model).init_weights(1)
    stages = drafter.model.mtp
    assert len(stages) > 1 and all(s.attn.rope is stages[0].attn.rope for s in stages)
    g = torch.Generator().manual_seed(0)
    n_blocks, gamma, window = 2, drafter.block_size, 6
    anchors = torch.randint(0, model.config.vocab_size, (n_blocks,), generator=g)
    starts = torch.tensor([7, 12])
    pools = [torch.randn(9, stage.head_dim if hasattr(stage, "head_dim") else drafter.model.head_dim, generator=g)
             for stage in stages]
    index = torch.randint(-1, 9, (n_blocks, window), generator=g)

    calls = {"cos_sin": 0, "own_block": 0}
    cos_sin, own_block = Rope.cos_sin, BlockRows.own_block
    monkeypatch.setattr(Rope, "cos_sin", lambda *a: calls.__setitem__("cos_sin", calls["cos_sin"] + 1) or cos_sin(*a))
    monkeypatch.setattr(BlockRows, "own_block",
                        lambda self, n: calls.__setitem__("own_block", calls["own_block"] + 1) or own_block(self, n))
    built = {"n": 0}
    init = BlockRows.__init__
    monkeypatch.setattr(BlockRows, "__init__",
                        lambda self, *a: built.__setitem__("n", built["n"] + 1) or init(self, *a))
    with torch.no_grad():
        shared = drafter.block_from(anchors, starts, pools, index).out
    assert calls["cos_sin"] == 1 and built["n"] == 1  # one call's rows for every stage
    assert calls["own_block"] == len(stages)  # asked by each stage, built once (pools of one length)

    monkeypatch.setattr(drafter.model, "blocks", _unshared_blocks(drafter.model))
    with torch.no_grad():
        alone = drafter.block_from(anchors, starts, pools, index).out
    for got, want in zip((shared.hidden_pre, shared.hidden, shared.base), (alone.hidden_pre, alone.hidden, alone.base)):
        assert torch.equal(got, want)


def _unshared_blocks(dspark_model):
    """`blocks` with every stage building its own rows (the former code path)."""
    original = dspark_model.blocks

    def blocks(*args):
        calls = []
        for stage in dspark_model.mtp:
            forward = stage.forward
            calls.append((stage, forward))
            stage.forward = lambda *a, _f=forward: _f(*a[:-1], None) if isinstance(a[-1], BlockRows) else _f(*a)
        try:
            return original(*args)
        finally:
            for stage, forward in calls:
                stage.forward = forward
    return blocks
