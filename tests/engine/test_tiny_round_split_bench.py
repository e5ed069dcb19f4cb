"""bench/tiny_round_split.py: every engine step lands in one kind, prefill apart, and an auto engine's
drafting rounds are the ones whose trace verified a draft."""

import dspark
from dspark.evaluate import encode_prompt, load_prompts
from tiny_auto import build_engine
from tiny_round_split import timed_steps


def test_steps_are_split_by_what_they_ran():
    model = dspark.load_model("tiny")
    prompts = [encode_prompt(model, t) for t in load_prompts("humaneval")[:2]]
    plain = build_engine(model, 0, 2, prompts, 12, trace=True)
    kinds = timed_steps(plain, prompts, 0.0, 0, 12)
    assert len(kinds["prefill"]) >= 1 and not kinds["drafting"]
    assert 10 <= len(kinds["plain"]) <= 12 and all(ms > 0 for ms in kinds["plain"])
    fixed = build_engine(model, 3, 2, prompts, 12, trace=True)  # every round drafts but the last (cap 0)
    kinds = timed_steps(fixed, prompts, 0.0, 0, 12)
    assert len(kinds["drafting"]) >= 3 and len(kinds["plain"]) <= 1


def test_a_profiled_serve_names_its_ops_per_step():
    from tiny_round_split import profiled_ops

    model = dspark.load_model("tiny")
    prompts = [encode_prompt(model, t) for t in load_prompts("humaneval")[:1]]
    engine = build_engine(model, "auto", 1, prompts, 6, trace=True)
    prof = profiled_ops(engine, prompts, 1.0, 6, top=5)
    assert prof["steps"] >= 2 and prof["host_us_per_step"] > 0 and len(prof["by_host"]) == 5
    assert prof["by_host"][0]["self_host_us"] >= prof["by_host"][-1]["self_host_us"] > 0
    assert not engine.has_work() and not engine.take_trace()
