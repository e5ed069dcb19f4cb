"""The bookkeeping of bench/hf_gemma.py: greedy splits with their margins, rows recovered from logs,
speedups per cell, and merging runs over disjoint domains."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hf_gemma.py"


@pytest.fixture(scope="module")
def hf_gemma():
    spec = importlib.util.spec_from_file_location("hf_gemma_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_greedy_splits_names_the_first_difference_and_plain_margin(hf_gemma, hf_targets):
    model = hf_targets["llama"]
    prompt = [3, 14, 15, 9]
    ids = torch.tensor(prompt)
    plain = [int(model(ids, [model.new_state()], [4]).logits[-1].argmax())]
    other = [(plain[0] + 1) % model.config.vocab_size]
    splits = hf_gemma.greedy_splits(model, [prompt, prompt], [plain, plain], [plain, other])
    assert [s["prompt"] for s in splits] == [1]  # identical outputs are not a split
    (split,) = splits
    assert (split["token"], split["plain_token"], split["other_token"]) == (0, plain[0], other[0])
    logits = model(ids, [model.new_state()], [4]).logits[-1].float()
    top = logits.topk(2).values
    assert split["plain_top2_margin"] == pytest.approx(float(top[0] - top[1]))
    assert split["plain_top2_margin"] > 0


def _row(domain, t, method, tok_s, decode_s=2.0):
    return {"domain": domain, "temperature": t, "method": method, "tau": 1.0, "new_tokens": 10, "rounds": 10,
            "decode_s": decode_s, "prefill_s": 0.5, "tok_per_s": tok_s}


def test_rows_from_logs_recovers_printed_rows_with_speedups_per_cell(hf_gemma, tmp_path):
    log = tmp_path / "eval.log"
    lines = ["Loading weights: 100%", json.dumps({"model": "m", "command": "python x"}),
             json.dumps(_row("math", 0.0, "plain", 10.0)), json.dumps(_row("math", 0.0, "dspark", 25.0)),
             json.dumps(_row("code", 1.0, "plain", 20.0)), json.dumps(_row("code", 1.0, "ngram", 10.0)),
             "AssertionError: ngram differs from plain greedy decoding on mt-bench"]
    log.write_text("\n".join(lines) + "\n")
    rows = hf_gemma.rows_from_logs([str(log)])
    assert [(r["domain"], r["method"]) for r in rows] == [("math", "plain"), ("math", "dspark"), ("code", "plain"),
                                                          ("code", "ngram")]
    assert [r["speedup_vs_plain"] for r in rows] == [1.0, 2.5, 1.0, 0.5]

    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    (drafter_dir / hf_gemma.SUMMARY_FILE).write_text(json.dumps({"conditions": {}, "training": {}, "calibration": {}}))
    out = tmp_path / "out.json"
    hf_gemma.write_from_logs([str(log)], str(drafter_dir), str(out))
    written = json.loads(out.read_text())
    assert written["eval"]["complete"] is False
    assert written["eval"]["greedy_outputs_equal_plain"] is False  # the assertion line is not lost
    assert written["runs"][0]["conditions"]["command"] == "python x"


def test_merge_refuses_overlapping_cells(hf_gemma, tmp_path):
    part = {"conditions": {"command": "c", "gpu": "g"}, "eval": {"sets": {"math": "m"}, "seconds": 1.0},
            "results": [_row("math", 0.0, "plain", 10.0)]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(part))
    b.write_text(json.dumps(part))
    with pytest.raises(ValueError, match="overlap"):
        hf_gemma.merge_results([str(a), str(b)], str(tmp_path / "m.json"))
