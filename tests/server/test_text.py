"""Streaming text invariants: deltas add up to the whole decode; stop strings cut at the first hit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.tokenizer import ByteTokenizer
from dspark_server.protocol import ChatCompletionRequest
from dspark_server.text import IncrementalDecoder, StopMatcher, render_chat

TOKENIZER = ByteTokenizer()
# Bytes of multi-byte characters, so that characters get split across pushes, plus specials.
BYTES = st.one_of(st.integers(0, 257), st.sampled_from(list("é✓😀".encode())))


@settings(max_examples=300, deadline=None, database=None)
@given(ids=st.lists(BYTES, max_size=40), cuts=st.lists(st.integers(1, 5), min_size=40, max_size=40))
def test_decoder_deltas_concatenate_to_the_full_decode(ids, cuts):
    decoder, out, i = IncrementalDecoder(TOKENIZER.decode), "", 0
    for k in cuts:
        delta = decoder.push(ids[i:i + k])
        assert not delta.endswith("\ufffd")  # a possibly incomplete character is never sent early
        out += delta
        i += k
    assert out + decoder.flush() == TOKENIZER.decode(ids)


def test_decoder_holds_back_a_split_character():
    decoder = IncrementalDecoder(TOKENIZER.decode)
    first, second = "✓".encode()[:2], "✓".encode()[2:]
    assert decoder.push(list(b"ok ") + list(first)) == "ok "
    assert decoder.push(list(second)) == "✓"
    assert decoder.push([0xFF]) == "" and decoder.flush() == "\ufffd"  # invalid for good: emitted at the end


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.text(alphabet="abc✓", max_size=30), stops=st.lists(st.text(alphabet="abc✓", min_size=1, max_size=4),
                                                                  min_size=1, max_size=3),
       cuts=st.lists(st.integers(1, 4), min_size=30, max_size=30))
def test_stop_matcher_cuts_where_the_first_stop_completes_whatever_the_split(text, stops, cuts):
    matcher, out, i = StopMatcher(stops), "", 0
    for k in cuts:
        out += matcher.feed(text[i:i + k])
        i += k
    out += matcher.flush()
    # Reference: feed one character at a time and stop at the first point where a stop string ends.
    end = next((n for n in range(1, len(text) + 1) if any(text[:n].endswith(s) for s in stops)), None)
    hits = [text[:end].rfind(s) for s in stops if text[:end].endswith(s)] if end else []
    assert out == (text[:min(hits)] if hits else text)
    assert matcher.stopped == bool(hits)


def test_default_chat_template_is_the_documented_one():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(TOKENIZER, messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_tokenizer_chat_template_is_used_and_its_errors_are_value_errors():
    class Templated:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            if messages[0]["role"] != "user":
                raise RuntimeError("conversation must start with the user")
            return "|".join(m["content"] for m in messages) + "|>"

    assert render_chat(Templated(), [{"role": "user", "content": "a"}]) == "a|>"
    with pytest.raises(ValueError, match="must start with the user"):
        render_chat(Templated(), [{"role": "system", "content": "a"}])


def test_text_parts_are_joined_and_names_kept():
    body = ChatCompletionRequest(messages=[{"role": "user", "name": "ann", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}])
    assert body.messages[0].content == "one\ntwo" and body.messages[0].name == "ann"
