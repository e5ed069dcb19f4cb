"""bench/tiny_auto.py: a cell counts all its tokens over all its time, and apart the tokens and time of
the steps that ran no prompt chunk (the decode-only rate, which the prefill does not dilute)."""

import dspark
from dspark.evaluate import encode_prompt, load_prompts
from tiny_auto import _versus_best, build_engine, run_cell


def test_a_cell_splits_off_its_prefill_steps():
    model = dspark.load_model("tiny")
    prompts = [encode_prompt(model, t) for t in load_prompts("humaneval")[:2]]
    engine = build_engine(model, 2, 2, prompts, 10)
    cell = run_cell(engine, prompts, 0.0, 0, 10, batch=2)
    assert cell["tokens"] == 20 and cell["rounds"] >= 2
    # each request's first token comes from its prefill step: the decode steps commit the other nine
    assert cell["decode_tokens"] == 18 and 0 < cell["decode_seconds"] < cell["seconds"]


def test_auto_is_set_against_the_best_fixed_budget_by_either_rate():
    rows = [{"temperature": 0.0, "draft_tokens": b, "tok_s": t, "decode_tok_s": d}
            for b, t, d in ((0, 10.0, 20.0), (3, 12.0, 30.0), ("auto", 11.0, 27.0))]
    assert _versus_best(rows, 0.0, "tok_s", "") == {"best_fixed": 3, "best_fixed_tok_s": 12.0, "auto_tok_s": 11.0,
                                                     "auto_over_best": 11.0 / 12.0}
    assert _versus_best(rows, 0.0, "decode_tok_s", "decode_")["decode_auto_over_best"] == 0.9
