"""The official `openai` client against a live server: both endpoints, whole and streamed."""

from __future__ import annotations

import dspark
import openai
import pytest

from dspark_server.text import render_chat

REPEATING = "aaaaaaaaaaaaaaaa"  # the random model repeats here, so n-gram drafts get accepted


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60) as c:
        yield c


def _offline(server, prompt: str, n: int):
    return dspark.generate(server.model, prompt, max_new_tokens=n)


def test_models_lists_the_served_name(oai, server):
    (card,) = oai.models.list().data
    assert card.id == server.model_name and card.owned_by == "dspark"
    assert card.model_extra["max_model_len"] == server.model.config.max_position_embeddings


def test_completion_matches_offline_generate_and_reports_speculation(oai, server):
    out = oai.completions.create(model=server.model_name, prompt=REPEATING, max_tokens=24, temperature=0)
    ref = _offline(server, REPEATING, 24)
    choice = out.choices[0]
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(REPEATING), len(ref.token_ids))
    spec = out.model_extra["metrics"]["speculative_decoding"]
    # Every verify step commits its accepted drafts plus one token, except a last step cut by the limit.
    assert 0 < len(ref.token_ids) - 1 <= spec["num_spec_steps"] + spec["num_accepted_draft_tokens"]
    assert spec["num_accepted_draft_tokens"] > 0, "n-gram drafts on a repeating output should be accepted"
    assert spec["mean_acceptance_length"] == pytest.approx((len(ref.token_ids) - 1) / spec["num_spec_steps"])
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    assert sum(spec["per_position_accepted"]) == spec["num_accepted_draft_tokens"]


def test_completion_stream_concatenates_to_the_whole_answer(oai, server):
    chunks = list(oai.completions.create(model=server.model_name, prompt="Hello, world", max_tokens=20, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    ref = _offline(server, "Hello, world", 20)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == ref.finish_reason
    assert "speculative_decoding" in finishing[0].model_extra["metrics"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_uses_the_default_template(oai, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = oai.chat.completions.create(model=server.model_name, messages=messages, max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True})
    prompt = render_chat(server.model.tokenizer, messages)
    ref = _offline(server, prompt, 16)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.model_extra["prompt_token_ids"] == list(prompt.encode())
    assert out.usage.total_tokens == len(prompt.encode()) + len(ref.token_ids)


def test_chat_stream_opens_with_the_role_and_ends_with_a_reason(oai, server):
    messages = [{"role": "user", "content": "Tell me a story"}]
    chunks = list(oai.chat.completions.create(model=server.model_name, messages=messages, max_tokens=12, temperature=0,
                                              stream=True))
    ref = _offline(server, render_chat(server.model.tokenizer, messages), 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_stop_string_cuts_the_text_whole_and_streamed(oai, server):
    ref = _offline(server, "Hello, world", 20).text
    stop = ref[5:7]  # a stop string the greedy continuation is known to produce
    cut = ref[:ref.find(stop)]
    whole = oai.completions.create(model=server.model_name, prompt="Hello, world", max_tokens=20, temperature=0, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(model=server.model_name, prompt="Hello, world", max_tokens=20, temperature=0, stop=stop,
                                      stream=True)
    pieces = list(streamed)
    assert "".join(c.choices[0].text for c in pieces) == cut
    assert pieces[-1].choices[0].finish_reason == "stop"
    assert server.wait_idle(), "a request stopped by a stop string must be aborted in the engine"


def test_seeded_sampling_repeats_and_top_k_is_accepted(oai, server):
    kwargs = dict(model=server.model_name, prompt="Once upon", max_tokens=12, temperature=0.8, top_p=0.9, seed=1234,
                  extra_body={"top_k": 20, "return_token_ids": True})
    first, second = (oai.completions.create(**kwargs).choices[0] for _ in range(2))
    assert first.model_extra["token_ids"] == second.model_extra["token_ids"]
    assert len(first.model_extra["token_ids"]) >= 1


def test_n_choices_whole_and_streamed(oai, server):
    """`n` choices: whole responses list them by index, usage counts the prompt once and every
    choice's tokens; with a seed choice i is what a single request with seed + i gives (distinct and
    reproducible); streams interleave the choices' chunks, each ending with its own finish_reason."""
    kwargs = dict(model=server.model_name, prompt="Once upon", max_tokens=10, temperature=0.9, seed=77,
                  extra_body={"return_token_ids": True})
    out = oai.completions.create(n=3, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in out.choices]
    singles = [oai.completions.create(**{**kwargs, "seed": 77 + i}).choices[0].model_extra["token_ids"] for i in range(3)]
    assert ids == singles and len({tuple(x) for x in ids}) > 1
    assert out.usage.prompt_tokens == len("Once upon") and out.usage.completion_tokens == sum(map(len, ids))
    spec = out.model_extra["metrics"]["speculative_decoding"]
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    greedy = oai.completions.create(model=server.model_name, prompt=REPEATING, max_tokens=8, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text == _offline(server, REPEATING, 8).text
    chunks = list(oai.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: out.choices[0].text, 1: out.choices[1].text}
    finishing = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishing) == [0, 1] and chunks[-1].usage.completion_tokens == sum(map(len, ids[:2]))
    chat = list(oai.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, n=2, stream=True))
    assert sorted(c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant") == [0, 1]
    assert sorted(c.choices[0].index for c in chat if c.choices[0].finish_reason) == [0, 1]
    assert server.wait_idle(), "every choice's engine request must end"


def test_echo_puts_the_prompt_before_each_choice(oai, server):
    out = oai.completions.create(model=server.model_name, prompt="Hello", max_tokens=6, temperature=0, echo=True, n=2)
    ref = _offline(server, "Hello", 6)
    assert [c.text for c in out.choices] == ["Hello" + ref.text] * 2
    chunks = list(oai.completions.create(model=server.model_name, prompt="Hello", max_tokens=6, temperature=0,
                                         echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello" + ref.text
    ids = oai.completions.create(model=server.model_name, prompt=list(b"Hi"), max_tokens=2, temperature=0, echo=True)
    assert ids.choices[0].text.startswith("Hi")


def test_client_errors_surface_as_openai_exceptions(oai, server):
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=server.model_name, prompt="x", max_tokens=2, n=0)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.AuthenticationError):
        with openai.OpenAI(base_url=oai.base_url, api_key="wrong", max_retries=0) as bad:
            bad.models.list()
