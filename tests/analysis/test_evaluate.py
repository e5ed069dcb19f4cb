"""`dspark eval-accept` end to end on random-tiny with n-gram drafting; its summary matches its traces."""

import json
import math

import pytest

from dspark.analysis import domain_table, read_traces, summary_row
from dspark.cli import main
from dspark.evaluate import SHIPPED_DATASETS, EvalConfig, load_prompts, parse_budget


def _same(a, b):
    """Equal up to float rounding, with summary.json's null standing for NaN."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    return a == pytest.approx(b)


def test_eval_accept_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["eval-accept", "--model", "random-tiny", "--dataset", "gsm8k,humaneval,mt-bench",
                 "--limit", "3", "--temperature", "0", "--budget", "all", "--drafter", "ngram",
                 "--max-new-tokens", "20", "--concurrency", "9", "--out", str(out), "--device", "cpu"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = read_traces(out / "traces.jsonl")
    c = summary["conditions"]
    assert (c["model"], c["drafter"], c["budget"], c["temperature"], c["gamma"], c["limit"]) == \
        ("random-tiny", "ngram", "all", 0.0, 5, 3)
    assert summary["counts"]["prompts"] == 9 and summary["counts"]["skipped"] == []
    assert summary["counts"]["rounds"] == len(records)
    assert summary["counts"]["new_tokens"] == sum(r["committed"] for r in records) + 9   # + prefill tokens
    assert [r["domain"] for r in summary["domains"]] == ["gsm8k", "humaneval", "mt-bench"]
    assert all(r["requests"] == 3 for r in summary["domains"])
    assert all(r["verified"] == min(5, 20 - r["position"] - 1) for r in records)         # verify-all
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    assert _same(summary["domains"], domain_table(records, ["gsm8k", "humaneval", "mt-bench"]))
    assert _same(summary["overall"], summary_row(records))
    assert "gsm8k" in capsys.readouterr().out


def test_shipped_subsets_load():
    for name in SHIPPED_DATASETS:
        prompts = load_prompts(name)
        assert len(prompts) == 20 and all(isinstance(p, str) and p for p in prompts)


def test_full_sets_from_a_folder(tmp_path):
    (tmp_path / "tiny.jsonl").write_text('{"turns": ["first", "second"]}\n\n{"turns": ["again"]}\n')
    assert load_prompts("tiny", tmp_path) == ["first", "again"]
    with pytest.raises(ValueError, match=r"dataset 'gsm8k' not found in .* \(tiny\)"):
        load_prompts("gsm8k", tmp_path)
    (tmp_path / "broken.jsonl").write_text('{"turns": ["ok"]}\n["no turns"]\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: expected"):
        load_prompts("broken", tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": -1}, "budget must be 'all', 'auto' or an int >= 0, got -1"),
    ({"drafter": "eagle"}, "drafter must be one of"),
    ({"limit": 0}, "limit must be a positive int, got 0"),
    ({"datasets": ("gsm8k", "gsm8k")}, "lists a set twice"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvalConfig(**kwargs)


def test_cli_reports_bad_values(tmp_path, capsys):
    assert parse_budget("auto") == "auto" and parse_budget("3") == 3
    with pytest.raises(SystemExit) as exc:
        main(["eval-accept", "--dataset", "nope", "--limit", "1", "--out", str(tmp_path), "--device", "cpu"])
    assert exc.value.code == 2 and "dataset 'nope' not found" in capsys.readouterr().err


def test_chat_template_wraps_the_first_turn():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dspark.evaluate import encode_prompt

    vocab = {"[unk]": 0, "<user>": 1, "<assistant>": 2, "hello": 3, "world": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[unk]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    model = type("Stub", (), {"tokenizer": tokenizer})()
    assert encode_prompt(model, "hello world") == [3, 4]                         # no template: raw text
    tokenizer.chat_template = ("{% for m in messages %}<user> {{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %} <assistant>{% endif %}")
    assert encode_prompt(model, "hello world") == [1, 3, 4, 2]


def test_a_sampled_evaluation_plans_by_the_drafters_sampled_table(tmp_path, monkeypatch):
    """eval-accept fills in the table the engine would pick for its requests: at T > 0 the drafter's
    sampled one (`capacity-<device>-sampled.json`), at T = 0 the greedy one."""
    import dspark
    from dspark.verify.capacity import CapacityTable

    model = dspark.load_model("tiny")
    tables = {"cpu": CapacityTable((2, 6), (50.0, 40.0), "greedy rounds"),
              "cpu-sampled": CapacityTable((2, 6), (30.0, 20.0), "sampled rounds")}
    monkeypatch.setattr(model.dspark, "capacity_tables", tables)
    from dspark.evaluate import eval_accept

    for temperature, label in ((1.0, "sampled rounds"), (0.0, "greedy rounds")):
        config = EvalConfig(datasets=("gsm8k",), limit=1, temperature=temperature, budget="auto", drafter="dspark",
                            max_new_tokens=4)
        summary = eval_accept(model, config, tmp_path / str(temperature))
        assert summary["conditions"]["capacity"] == label
