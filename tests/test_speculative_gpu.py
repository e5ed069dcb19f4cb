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
