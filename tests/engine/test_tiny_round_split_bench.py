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
