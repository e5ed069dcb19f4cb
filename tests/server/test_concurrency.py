"""Many clients at once: exact outputs, aborts on disconnect, 429 backpressure, clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import dspark
import httpx
import openai
import pytest
import torch

from dspark.draft import NgramDrafter
from dspark_server.text import render_chat

LONG = "The quick brown fox"


def _prompts(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "aaaa", "zeta", "the", "cat", "sat", "on", "a", "mat"]
    return [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(torch.randint(1, 12, (1,), generator=g)),),
                                                          generator=g)) for _ in range(n)]


def test_32_concurrent_streams_equal_offline_generate(server):
    """Greedy outputs of 32 simultaneous streams (16 completions, 16 chats; more than max_running,
    so some wait) are token-for-token those of `dspark.generate` run alone."""
    prompts, n = _prompts(32, seed=3), 12
    texts = [p if i % 2 == 0 else render_chat(server.model.tokenizer, [{"role": "user", "content": p}])
             for i, p in enumerate(prompts)]
    reference = dspark.generate(server.model, texts, max_new_tokens=n)

    async def one(client, i):
        common = dict(model=server.model_name, max_tokens=n, temperature=0, stream=True,
                      extra_body={"return_token_ids": True})
        if i % 2 == 0:
            stream = await client.completions.create(prompt=prompts[i], **common)
            text_of = lambda c: c.choices[0].text if c.choices else ""  # noqa: E731
        else:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompts[i]}], **common)
            text_of = lambda c: (c.choices[0].delta.content or "") if c.choices else ""  # noqa: E731
        text, ids, reason = "", [], None
        async for chunk in stream:
            text += text_of(chunk)
            ids += (chunk.choices[0].model_extra or {}).get("token_ids") or [] if chunk.choices else []
            reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
        return text, ids, reason

    async def all_clients():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_clients())
    for (text, ids, reason), ref in zip(results, reference):
        assert ids == ref.token_ids and text == ref.text and reason == ref.finish_reason
    assert server.wait_idle()


def _abort_count(client) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "dspark:request_success_total" and sample.labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


def test_disconnects_mid_stream_and_mid_request_free_everything(make_server):
    """20 streams dropped after their first tokens, and 2 non-streaming requests whose client times
    out, leave no request in the engine and none in the bridge; each counts as an abort."""
    server = make_server(eos=False, max_running=16, max_new_tokens=400, draft_tokens=3, drafter="ngram")
    client = server.client()
    aborts_before = _abort_count(client)
    body = {"prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
    got_tokens = []

    def drop_stream():
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and '"text":""' not in line:
                    got_tokens.append(1)
                    return  # leaving the block closes the connection mid-stream

    def time_out_whole_request():
        with server.client(timeout=0.5) as c, pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json={**body, "stream": False})

    threads = [threading.Thread(target=drop_stream) for _ in range(20)]
    threads += [threading.Thread(target=time_out_whole_request) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got_tokens) == 20
    # 400 tokens take far longer than this: only aborts can empty the engine in time.
    assert server.wait_idle(timeout=10), "disconnected requests are still in the engine"
    assert not server.engine.waiting and not server.engine.running
    deadline = time.monotonic() + 5
    while _abort_count(client) < aborts_before + 22 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort_count(client) == aborts_before + 22
    assert client.get("/health").status_code == 200
    client.close()


@pytest.fixture
def small_server(make_server):
    return make_server(eos=False, max_running=1, max_waiting=1, max_new_tokens=400, drain_s=0.5)


def test_full_queue_answers_429_then_recovers(small_server):
    """One running + one waiting fill the engine; the third request gets 429, and after those two
    end the server serves again."""
    body = {"prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
    with small_server.client() as c, c.stream("POST", "/v1/completions", json=body) as first:
        assert first.status_code == 200
        with small_server.client() as c2, c2.stream("POST", "/v1/completions", json=body) as second:
            assert second.status_code == 200
            third = c.post("/v1/completions", json={**body, "stream": False})
            assert third.status_code == 429
            assert third.json()["error"]["type"] == "rate_limit_error"
    assert small_server.wait_idle()
    with small_server.client() as c:
        again = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1


def test_n_choices_are_queued_all_or_none(small_server):
    """A request for 3 choices where the engine holds 2 (one running, one waiting) gets 429, and the
    choices it had queued are aborted: the engine is left empty and serves again."""
    with small_server.client() as c:
        refused = c.post("/v1/completions", json={"prompt": LONG, "max_tokens": 400, "temperature": 0, "n": 3})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert small_server.wait_idle(timeout=10), "the choices queued before the refusal are still in the engine"
        both = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2})
        assert both.status_code == 200 and [ch["index"] for ch in both.json()["choices"]] == [0, 1]


def test_shutdown_drains_then_aborts_and_refuses_new_requests(small_server):
    """During shutdown new requests get 503 and /health turns 503; a stream still running after the
    drain deadline ends with finish_reason "abort" and a clean [DONE]."""
    body = {"prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
    lines = []
    with small_server.client() as c, c.stream("POST", "/v1/completions", json=body) as stream:
        it = stream.iter_lines()
        lines.append(next(it))
        shutdown = asyncio.run_coroutine_threadsafe(small_server.async_engine.shutdown(drain_s=0.5),
                                                    small_server.async_engine._task.get_loop())
        refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert c.get("/health").status_code == 503
        lines += list(it)
        shutdown.result(timeout=10)
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"abort"' in events[-2]
    assert not small_server.engine.has_work()


class _FailsOnce(NgramDrafter):
    """An n-gram drafter whose first proposal raises, standing in for any bug inside a step."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "failed", False)

    def propose(self, *args, **kwargs):
        if not self.failed:
            object.__setattr__(self, "failed", True)
            raise RuntimeError("injected drafter failure")
        return super().propose(*args, **kwargs)


def test_a_failing_step_fails_its_requests_not_the_server(make_server):
    """A step that raises answers 500 (an OpenAI error body, no traceback) to the requests it held,
    leaves the engine empty, and the next request is served normally."""
    live = make_server(draft_tokens=2, drafter=_FailsOnce())
    with live.client() as c:
        broken = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0})
        assert broken.status_code == 500
        assert broken.json()["error"]["code"] == "engine_failed" and "Traceback" not in broken.text
        assert live.wait_idle() and not live.engine.has_work()
        healthy = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0})
        assert healthy.status_code == 200
        assert healthy.json()["usage"]["completion_tokens"] >= 1
        assert c.get("/health").status_code == 200
