"""Speculative decoding on CUDA: the round builds its tensors on the model's device (a CPU-only suite
cannot catch a device mismatch there)."""

import pytest
import torch

import dspark


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
def test_speculative_on_cuda_equals_plain(drafter):
    model = dspark.load_model("tiny", device="cuda", dtype=torch.float32)
    prompts = ["def read_config(path):\n    ", "ROMEO.\nBut soft, what light"]
    plain = dspark.generate(model, prompts, max_new_tokens=24)
    spec = dspark.generate(model, prompts, max_new_tokens=24, draft_tokens=3, drafter=drafter)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
def test_sampled_speculative_runs_on_cuda_and_is_seeded(drafter):
    """T > 0 on CUDA: the request generators live on the model's device (the sampling noise is drawn
    there), and one seed gives one output."""
    model = dspark.load_model("tiny", device="cuda", dtype=torch.float32)
    prompts = ["def read_config(path):\n    ", "ROMEO.\nBut soft, what light"]
    runs = [dspark.generate(model, prompts, max_new_tokens=24, temperature=1.0, seed=5, draft_tokens=3,
                            drafter=drafter) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) > 0 for o in runs[0])
