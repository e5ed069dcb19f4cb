"""DSpark losses, position weights, anchors/blocks and the LR schedule against hand-computed values."""

import math

import pytest
import torch

from dspark.train.anchors import build_blocks, candidate_anchors, context_index, position_weights, sample_anchors
from dspark.train.losses import LossWeights, dspark_loss, per_slot_losses, probabilistic_tau
from dspark.train.trainer import TrainConfig, lr_factor


def _example():
    """Two slots over V = 3 with easy numbers.

    slot 0: p_d = softmax([0, ln 2, 0]) = (1/4, 1/2, 1/4), p_t = (1/2, 1/2, 0), label 1, z = 0
    slot 1: p_d = (1/3, 1/3, 1/3),                         p_t = (1, 0, 0),     label 0, z = ln 3
    """
    logits = torch.tensor([[[0.0, math.log(2), 0.0], [0.0, 0.0, 0.0]]])
    teacher = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    labels = torch.tensor([[1, 0]])
    z = torch.tensor([[0.0, math.log(3)]])
    return logits, z, teacher, labels


def test_per_slot_losses_by_hand():
    terms = per_slot_losses(*_example())
    torch.testing.assert_close(terms["ce"], torch.tensor([[math.log(2), math.log(3)]]))
    # Full L1 (not halved): |1/4 − 1/2| + 0 + |1/4 − 0| = 1/2 and 2/3 + 1/3 + 1/3 = 4/3.
    torch.testing.assert_close(terms["tv"], torch.tensor([[0.5, 4 / 3]]))
    torch.testing.assert_close(terms["accept"], torch.tensor([[0.75, 1 / 3]]))
    bce1 = -(0.75 * math.log(0.5) + 0.25 * math.log(0.5))
    bce2 = -(1 / 3 * math.log(0.75) + 2 / 3 * math.log(0.25))  # σ(ln 3) = 3/4
    torch.testing.assert_close(terms["conf"], torch.tensor([[bce1, bce2]]))


def test_weighted_total_by_hand_and_global_normaliser():
    logits, z, teacher, labels = _example()
    w = torch.tensor([[1.0, 0.5]])
    loss, metrics = dspark_loss(logits, z, teacher, labels, w)
    bce1 = math.log(2)
    bce2 = -(1 / 3 * math.log(0.75) + 2 / 3 * math.log(0.25))
    ce = math.log(2) + 0.5 * math.log(3)
    tv = 0.5 + 0.5 * 4 / 3
    conf = bce1 + 0.5 * bce2
    assert float(loss) == pytest.approx((0.1 * ce + 0.9 * tv + 1.0 * conf) / 1.5, rel=1e-6)
    assert metrics["tv"] == pytest.approx(tv / 1.5, rel=1e-6)
    assert metrics["accept"] == pytest.approx((0.75 + 0.5 / 3) / 1.5, rel=1e-6)
    # The step normaliser replaces Σ w: this group's share of a step with total weight 6.
    share, _ = dspark_loss(logits, z, teacher, labels, w, LossWeights(ce=1.0, tv=0.0, conf=0.0), normalizer=6.0)
    assert float(share) == pytest.approx(ce / 6.0, rel=1e-6)


def test_confidence_label_is_detached():
    logits, z, teacher, labels = _example()
    logits.requires_grad_(True)
    loss, _ = dspark_loss(logits, z, teacher, labels, torch.ones(1, 2), LossWeights(ce=0.0, tv=0.0, conf=1.0))
    loss.backward()
    # The soft label 1 − ½‖p_d − p_t‖₁ depends on the draft logits, but is detached: no gradient flows.
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_position_weights():
    torch.testing.assert_close(position_weights(7), torch.exp(-torch.arange(7.0) / 4))  # g = 4 at γ = 7
    torch.testing.assert_close(position_weights(5), torch.exp(-torch.arange(5.0) * 7 / 20))  # g = 4·5/7
    torch.testing.assert_close(position_weights(3, decay=1.0), torch.exp(-torch.arange(3.0)))
    with pytest.raises(ValueError, match="decay"):
        position_weights(3, decay=0.0)


def test_anchor_candidates_and_sampling():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 1])
    assert candidate_anchors(mask).tolist() == [2, 3, 4, 5, 6]
    g = torch.Generator().manual_seed(0)
    picked = sample_anchors(mask, 3, g)
    assert len(picked) == 3 and picked.tolist() == sorted(set(picked.tolist()))
    assert set(picked.tolist()) <= {2, 3, 4, 5, 6}
    assert sample_anchors(mask, 10, g).tolist() == [2, 3, 4, 5, 6]


def test_blocks_labels_teacher_rows_and_valid_prefix():
    ids = torch.arange(10, 20)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 1])
    b = build_blocks(ids, mask, torch.tensor([5, 6, 2]), gamma=4, noise_token_id=99, decay=1.0)
    assert b.input_ids.tolist() == [[15, 99, 99, 99], [16, 99, 99, 99], [12, 99, 99, 99]]
    assert b.positions.tolist()[0] == [5, 6, 7, 8]
    assert b.labels.tolist()[0] == [16, 17, 18, 19]  # slot k predicts position a + k + 1
    assert b.prev.tolist()[0] == [15, 16, 17, 18]  # teacher-forced x_{k-1}: anchor, then the labels
    assert b.teacher_rows.tolist()[0] == [5, 6, 7, 8]  # target row a + k predicts position a + k + 1
    e = math.exp(-1.0)
    # a = 5: label 18 (position 8) is a prompt token, so slots 2, 3 drop although 19 is a response token.
    torch.testing.assert_close(b.weights[0], torch.tensor([1.0, e, 0.0, 0.0]))
    torch.testing.assert_close(b.weights[1], torch.tensor([1.0, 0.0, 0.0, 0.0]))  # a = 6
    torch.testing.assert_close(b.weights[2], torch.tensor([1.0, e, e * e, e ** 3]))  # a = 2: labels 3..6
    end = build_blocks(ids, torch.ones(10, dtype=torch.long), torch.tensor([8]), gamma=4, noise_token_id=99, decay=1.0)
    torch.testing.assert_close(end.weights[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))  # past the end
    assert end.labels.max() < 20 and end.teacher_rows.max() <= 9  # clamped into the sequence


def test_context_is_strictly_before_the_anchor_within_the_window():
    index = context_index(torch.tensor([0, 3, 10]), window=4)
    assert index.tolist() == [[-1, -1, -1, -1], [-1, 0, 1, 2], [6, 7, 8, 9]]


def test_probabilistic_tau():
    accept = torch.tensor([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert probabilistic_tau(accept, mask) == pytest.approx(1 + ((0.5 + 0.25 + 0.25) + 1.0) / 2)


def test_warmup_then_cosine():
    assert [lr_factor(s, 100, 0.04) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(52, 100, 0.04) == pytest.approx(0.5)
    assert lr_factor(99, 100, 0.04) == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 96)))
    assert lr_factor(0, 10, 0.0) == 1.0


@pytest.mark.parametrize("kwargs, needle", [
    (dict(steps=0), "steps"), (dict(lr=0.0), "lr"), (dict(warmup_ratio=1.0), "warmup_ratio"),
    (dict(num_anchors=0), "num_anchors"), (dict(grad_clip=-1.0), "grad_clip"), (dict(save_every=-1), "save_every"),
])
def test_bad_train_config_is_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**kwargs)


def test_bad_loss_weight_is_named():
    with pytest.raises(ValueError, match="tv"):
        LossWeights(tv=-1.0)
