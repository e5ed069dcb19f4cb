"""DSpark drafting and train-draft against a DeepSeek-V4.1 target (whose default prefill is the
bounded replay, which leaves early prompt rows uncomputed)."""

import json
import math
from importlib import resources

import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.train.data import TrainingSequence
from dspark.train.trainer import TrainConfig, train_draft


def _target():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v41.json").read_text())
    return dspark.init_model(config, seed=0)


def test_train_draft_on_a_v41_target_sees_every_row():
    target = _target()
    g = torch.Generator().manual_seed(0)
    # Sequences much longer than the window (8): a bounded-replay prefill would give NaN features.
    data = [TrainingSequence(tuple(torch.randint(0, 256, (40,), generator=g).tolist()), (1,) * 40)
            for _ in range(4)]
    cfg = DSparkConfig.for_target(target.config, dspark_markov_rank=16, dspark_n_routed_experts=2,
                                  dspark_n_activated_experts=1)
    result = train_draft(target, data, TrainConfig(steps=3, batch_size=2, num_anchors=4, progress=False),
                         dspark_config=cfg)
    losses = [h["loss"] for h in result.history]
    assert losses and all(math.isfinite(x) for x in losses)


def test_dspark_drafter_on_a_v41_target_is_exact():
    target = _target()
    drafter = DSparkDrafter(target).init_weights(0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 12, 30)]
    plain = dspark.generate(target, prompts, max_new_tokens=16)
    spec = dspark.generate(target, prompts, max_new_tokens=16, draft_tokens=5, drafter=drafter)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
