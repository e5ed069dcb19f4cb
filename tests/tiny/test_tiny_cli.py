"""The four module entry points chained as in docs/dspark-tiny.md, on the synthetic sources, and the
GPU script's shell syntax."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from tiny_sources import make_sources

import dspark
from dspark.tiny import corpus, packing, pretrain, tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_corpus_tokenizer_packing_pretrain_chain(tmp_path, capsys):
    code, prose = make_sources(tmp_path / "src")
    data = tmp_path / "tiny-data"
    assert corpus.main(["--out", str(data / "corpus"), "--code-root", str(code), "--prose-root", str(prose),
                        "--heldout-code", "0.2", "--heldout-prose", "0.2"]) == 0
    assert tokenizer.main(["--corpus", str(data / "corpus"), "--out", str(data / "tokenizer"),
                           "--vocab-size", "360"]) == 0
    stats = json.loads((data / "tokenizer" / "stats.json").read_text())
    assert stats["vocab_size"] == 360 and set(stats["bytes_per_token"]) == {
        "code.train", "code.heldout", "prose.train", "prose.heldout"}
    assert packing.main(["--corpus", str(data / "corpus"), "--tokenizer", str(data / "tokenizer"),
                         "--out", str(data / "packed"), "--seq-len", "16"]) == 0
    out = tmp_path / "ckpt"
    config = Path(dspark.__file__).parent / "configs" / "tiny-v4.json"
    assert pretrain.main(["--config", str(config), "--data", str(data / "packed"), "--tokenizer",
                          str(data / "tokenizer"), "--out", str(out), "--steps", "4", "--batch-size", "2",
                          "--eval-rows", "2", "--save-dtype", "float32", "--device", "cpu", "--no-progress"]) == 0
    assert "held-out" in capsys.readouterr().out
    model = dspark.load_model(out)
    assert json.loads((out / "pretrain.json").read_text())["steps"] == 4
    assert isinstance(dspark.generate(model, "def f(x):", max_new_tokens=4).text, str)


def test_pretrain_cli_rejects_a_bad_value(tmp_path):
    with pytest.raises(ValueError, match="steps: 0"):
        pretrain.main(["--out", str(tmp_path), "--steps", "0"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_gpu_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "bench" / "train_tiny.sh")], check=True)
