"""Text on the way in and out: chat prompts, incremental detokenization, stop strings.

Default chat template (used when the tokenizer has none, e.g. the byte tokenizer of `random-tiny`):
every message becomes ``<|{role}|>\\n{content}\\n`` and the prompt ends with ``<|assistant|>\\n``,
so a system + user conversation reads::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder produces for bytes that do not (yet) form a character


def render_chat(tokenizer, messages: Sequence[dict]) -> str:
    """The prompt text for `messages` ({role, content[, name]} dicts), ready for generation.

    Uses the tokenizer's own chat template when it has one (transformers tokenizers), else the
    default template of the module docstring. A template that rejects the conversation raises
    ValueError (the server answers 400).
    """
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises its own types (TemplateError, raise_exception(...))
            raise ValueError(f"the model's chat template rejected the messages: {e}") from None
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class IncrementalDecoder:
    """Token ids in, text deltas out; the deltas concatenate to `decode(all ids)`.

    Decoding each token alone is wrong for byte-level vocabularies (a character can span tokens)
    and for tokenizers whose decoding of a token depends on its left neighbour (leading spaces), so
    each push re-decodes a short window: the tokens of the last completed delta plus the new ones.
    Trailing U+FFFD (a character still incomplete) is held back until a later push completes it,
    or until `flush` (a truly invalid byte sequence is then emitted as U+FFFD).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0  # window start: first token of the last completed delta
        self._done = 0  # tokens before this index are fully reflected in the emitted text
        self._partial = 0  # characters emitted beyond the decode of ids[:_done]

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._done == len(self._ids):
            return ""
        before = self._decode(self._ids[self._start:self._done])
        after = self._decode(self._ids[self._start:])
        sent = len(before) + self._partial
        if final or not after.endswith(REPLACEMENT):
            self._start, self._done, self._partial = self._done, len(self._ids), 0
            return after[sent:]
        stable = after.rstrip(REPLACEMENT)
        self._partial += max(len(stable) - sent, 0)
        return stable[sent:]


class StopMatcher:
    """Cuts generated text at the first stop string to complete, also when it arrives split across
    deltas.

    `feed` returns the text that is safe to show: it holds back the longest tail that could still
    grow into a stop string. `stopped` turns True once a stop string is found; the text is cut
    before it (OpenAI semantics: the stop string itself is not returned).
    """

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        text = self._held + delta
        # The stop that completes first wins (ties: the one starting first), as if the text had
        # arrived one character at a time; so the cut does not depend on how tokens were grouped
        # into steps (with stops "a" and "baa", "baa" arriving at once is cut to "b").
        hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)[1]]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
