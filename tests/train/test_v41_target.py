"""DSpark drafting and train-draft against a DeepSeek-V4.1 target (whose default prefill is the
bounded replay, which leaves early prompt rows uncomputed)."""

import json
import math
from importlib import resources

import pytest
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


def _sequences(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [TrainingSequence(tuple(torch.randint(0, 256, (length,), generator=g).tolist()), (1,) * length)
            for _ in range(n)]


def test_shipped_v41_stages_train_save_load_and_stay_exact(tmp_path):
    """The V4.1 release's own stage modules (`stage_kind="shipped"`: V4.1 blocks) train, and a drafter
    directory written from them records its stage kind and loads them back bit for bit."""
    from dspark.draft.io import load_drafter, save_drafter, v41_dspark_config
    from dspark.draft.stages_v41 import DSparkStageV41

    target = _target()
    result = train_draft(target, _sequences(4, 40, 2),
                         TrainConfig(steps=2, batch_size=2, num_anchors=4, progress=False), stage_kind="shipped")
    drafter = result.drafter
    assert drafter.model.stage_kind == "shipped" and all(isinstance(s, DSparkStageV41) for s in drafter.model.mtp)
    assert drafter.config == v41_dspark_config(target.config)  # what `add_to_checkpoint` requires
    assert all(math.isfinite(h["loss"]) for h in result.history)
    save_drafter(drafter, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["stage_kind"] == "shipped"
    back = load_drafter(tmp_path / "d", target, dtype=torch.float32)
    assert back.model.stage_kind == "shipped"
    mine, theirs = drafter.model.state_dict(), back.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17)]
    plain = dspark.generate(target, prompts, max_new_tokens=12)
    spec = dspark.generate(target, prompts, max_new_tokens=12, draft_tokens=3, drafter=back)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_drafter_directory_stage_kind_defaults_to_v4_and_is_checked(tmp_path):
    from dspark.draft.io import load_drafter, save_drafter

    target = _target()
    drafter = DSparkDrafter(target, DSparkConfig.for_target(target.config, dspark_markov_rank=8)).init_weights(0)
    save_drafter(drafter, tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    assert config.pop("stage_kind") == "v4"
    config_file.write_text(json.dumps(config))  # as directories written before the field
    assert load_drafter(tmp_path, target).model.stage_kind == "v4"
    config_file.write_text(json.dumps({**config, "stage_kind": "v5"}))
    with pytest.raises(ValueError, match="stage_kind 'v5' is not one of"):
        load_drafter(tmp_path, target)


def test_cli_trains_shipped_v41_stages_and_refuses_reshaping_them(tmp_path, capsys):
    from dspark.cli import main as cli_main
    from dspark.models.deepseek_v41.checkpoint import save_checkpoint
    from dspark.train.data import write_jsonl

    save_checkpoint(_target(), tmp_path / "ckpt", quantize=False)
    write_jsonl(_sequences(2, 24, 4), tmp_path / "train.jsonl")
    common = ["train-draft", "--model", str(tmp_path / "ckpt"), "--data", str(tmp_path / "train.jsonl"),
              "--steps", "1", "--num-anchors", "4", "--device", "cpu", "--stage-kind", "shipped"]
    with pytest.raises(SystemExit) as bad:
        cli_main([*common, "--out", str(tmp_path / "bad"), "--block-size", "3"])
    assert bad.value.code == 2 and "drop --block-size" in capsys.readouterr().err
    assert cli_main([*common, "--out", str(tmp_path / "d")]) == 0
    assert json.loads((tmp_path / "d" / "config.json").read_text())["stage_kind"] == "shipped"
