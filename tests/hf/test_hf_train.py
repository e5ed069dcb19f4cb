"""Training a DSpark drafter for a transformers target: `train_draft` learns the target's own
continuations (acceptance far above an untrained drafter, output still exact), and the CLI runs the
whole path on a saved transformers directory: target-cache → train-draft → calibrate-draft → load."""

import json

import pytest
import torch

import dspark
from dspark.cli import main as cli_main
from dspark.draft import DSparkConfig, save_drafter
from dspark.models.hf_causal import HFCausalLM
from dspark.train.data import read_jsonl, self_distill
from dspark.train.trainer import TrainConfig, new_training_drafter, train_draft


def _prompts(n, seed, vocab=64, length=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _tau(outs):
    return sum(o.stats.new_tokens - 1 for o in outs) / sum(o.stats.rounds for o in outs)


def test_trained_drafter_accepts_far_more_than_untrained_and_stays_exact(hf_targets):
    target = hf_targets["llama"]
    prompts = _prompts(12, seed=1)
    data = self_distill(target, prompts, max_new_tokens=24)
    config = DSparkConfig.for_target(target.config, dspark_markov_rank=16, dspark_block_size=4)
    trained = train_draft(target, data, TrainConfig(steps=120, num_anchors=16, lr=5e-3, seed=0, progress=False),
                          dspark_config=config).drafter
    untrained = new_training_drafter(target, config, seed=0)
    plain = [o.token_ids for o in dspark.generate(target, prompts, max_new_tokens=24)]
    taus = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        outs = dspark.generate(target, prompts, max_new_tokens=24, draft_tokens=4, drafter=drafter)
        assert [o.token_ids for o in outs] == plain, name
        taus[name] = _tau(outs)
    print(f"tau on the training prompts: {taus}")
    assert taus["trained"] > taus["untrained"] + 0.8


def test_cli_target_cache_train_calibrate_on_a_transformers_directory(make_tiny_hf, tmp_path):
    model_dir = tmp_path / "model"
    make_tiny_hf("qwen3").save_pretrained(model_dir)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in _prompts(3, 2)))
    data = tmp_path / "train.jsonl"
    assert cli_main(["target-cache", "--model", str(model_dir), "--prompts", str(tmp_path / "prompts.jsonl"),
                     "--out", str(data), "--max-new-tokens", "10", "--device", "cpu"]) == 0
    records = read_jsonl(data)
    assert len(records) == 3 and all(sum(r.loss_mask) == 10 and r.loss_mask[:6] == (0,) * 6 for r in records)
    target = dspark.load_model(model_dir)
    # The recorded continuations are the target's greedy ones.
    first = dspark.generate(target, list(records[0].input_ids[:6]), max_new_tokens=10)
    assert tuple(first.token_ids) == records[0].input_ids[6:]
    out = model_dir / "drafter"
    assert cli_main(["train-draft", "--model", str(model_dir), "--data", str(data), "--out", str(out),
                     "--steps", "3", "--num-anchors", "4", "--markov-rank", "8", "--device", "cpu"]) == 0
    assert cli_main(["calibrate-draft", "--model", str(model_dir), "--drafter", str(out), "--prompts",
                     str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "12", "--device", "cpu"]) == 0
    reloaded = dspark.load_model(model_dir)  # the drafter beside the weights becomes the model's own
    assert isinstance(reloaded, HFCausalLM) and reloaded.dspark is not None
    assert reloaded.dspark.block_size == 7 and reloaded.dspark.calibration is not None
    out_spec = dspark.generate(reloaded, list(records[1].input_ids[:6]), max_new_tokens=10, draft_tokens="auto")
    assert tuple(out_spec.token_ids) == records[1].input_ids[6:]


def test_stage_sizes_are_configurable(make_tiny_hf):
    target = dspark.load_model(make_tiny_hf("llama"), draft_stage={"num_attention_heads": 2, "n_routed_experts": 2,
                                                                   "moe_intermediate_size": 16})
    drafter = new_training_drafter(target, DSparkConfig.for_target(target.config, dspark_markov_rank=8))
    stage = drafter.model.mtp[0]
    assert stage.attn.n_heads == 2 and len(stage.ffn.experts) == 2
    with pytest.raises(ValueError, match="draft_stage.o_groups: 3 must divide num_attention_heads=2"):
        dspark.load_model(make_tiny_hf("llama"), draft_stage={"num_attention_heads": 2, "o_groups": 3})


def test_drafter_directory_records_the_stage_sizes(make_tiny_hf, tmp_path):
    """A drafter trained at non-default stage sizes loads for a target loaded without them (the
    directory records its `stage`), with the same weights and exact output."""
    shape = {"num_attention_heads": 2, "n_routed_experts": 2, "moe_intermediate_size": 16}
    hf = make_tiny_hf("llama")
    target = dspark.load_model(hf, draft_stage=shape)
    drafter = new_training_drafter(target, DSparkConfig.for_target(target.config, dspark_markov_rank=8), seed=1)
    save_drafter(drafter, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["stage"]["n_routed_experts"] == 2
    plain_target = dspark.load_model(hf)  # default stage sizes: 4 experts
    back = dspark.load_drafter(tmp_path, plain_target, dtype=torch.float32)
    assert back.model.mtp[0].attn.n_heads == 2 and len(back.model.mtp[0].ffn.experts) == 2
    mine, theirs = drafter.model.state_dict(), back.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    save_drafter(back, tmp_path / "again")  # re-saved at the recorded sizes, not the target's
    assert json.loads((tmp_path / "again" / "config.json").read_text())["stage"] == \
        json.loads((tmp_path / "config.json").read_text())["stage"]
    prompts = _prompts(2, seed=5)
    plain = [o.token_ids for o in dspark.generate(plain_target, prompts, max_new_tokens=8)]
    assert [o.token_ids for o in dspark.generate(plain_target, prompts, max_new_tokens=8, draft_tokens=3,
                                                 drafter=back)] == plain
