"""Bad input gets a 4xx with an OpenAI error body naming the problem, and the server stays healthy."""

from __future__ import annotations

import json

import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (path, JSON body, status, param the error must name)
BAD_JSON = [
    # wrong types: never coerced
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 3.5}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": True}, 400, "temperature"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "stop": 7}, 400, "stop"),
    (C, {"prompt": "x", "seed": "42"}, 400, "seed"),
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, {"prompt": "x", "model": 3}, 400, "model"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content"),
    # negative and huge values
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 513}, 400, "max_tokens"),  # server limit is 512
    (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1e-300}, 400, "top_p"),  # underflows in the float32 sampler
    (C, {"prompt": "x", "temperature": 5e-324}, 400, "temperature"),
    (C, {"prompt": "x", "top_k": -7}, 400, "top_k"),
    (C, {"prompt": "x", "seed": -1}, 400, "seed"),
    (C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    (C, {"prompt": [300]}, 400, "prompt"),  # outside the 258-token vocabulary
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    (C, {"prompt": "x" * 300}, 400, "prompt"),  # over max_prompt_tokens=256
    (CHAT, {"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
    # empty prompts
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [""]}, 400, "prompt"),
    (C, {"prompt": ["a", "b"]}, 400, "prompt"),
    (CHAT, {"messages": []}, 400, "messages"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    # unknown and unsupported fields
    (C, {"prompt": "x", "foo": 1}, 400, "foo"),
    (C, {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 17}, 400, "n"),  # over MAX_CHOICES
    (C, {"prompt": "x", "n": "2"}, 400, "n"),
    (C, {"prompt": "x", "n": True}, 400, "n"),
    (C, {"prompt": "x", "echo": 1}, 400, "echo"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (CHAT, {"messages": MSG, "echo": True}, 400, "echo"),  # completions only
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "logprobs": True}, 400, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "messages[0].tool_calls"),
    # unknown model
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_JSON, ids=[f"{p[-16:]}:{json.dumps(b)[:40]}" for p, b, *_ in BAD_JSON])
def test_bad_json_values_are_4xx_naming_the_field(client, path, body, status, param):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


# (path, raw body bytes, extra headers, status)
BAD_BODIES = [
    (C, b'{"prompt": "x",', {}, 400),                       # truncated JSON
    (C, b"", {}, 400),                                       # no body at all
    (C, b"[1, 2]", {}, 400),                                 # not an object
    (C, b"null", {}, 400),
    (C, b'{"prompt": "\xff\xfe bad utf-8"}', {}, 400),       # invalid UTF-8 bytes
    (C, b'{"prompt": "\\ud800 lone surrogate"}', {}, 400),   # valid JSON, invalid Unicode
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', {}, 400),
    (C, b'{"prompt": "x", "temperature": NaN}', {}, 400),
    (C, b'{"prompt": "x", "temperature": 1e999}', {}, 400),  # parses to infinity
    (C, b'{"prompt": "x"}', {"content-type": "text/plain"}, 400),
    (C, b'{"prompt": "' + b"y" * 70_000 + b'"}', {}, 413),  # over max_body_bytes=64 KiB
]


@pytest.mark.parametrize("path,raw,headers,status", BAD_BODIES, ids=[r[:30].decode("latin-1") for _, r, _, _ in BAD_BODIES])
def test_malformed_bodies_are_4xx(client, path, raw, headers, status):
    response = client.post(path, content=raw, headers={"content-type": "application/json", **headers})
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


def test_chunked_oversized_body_is_413(client):
    def chunks():  # no Content-Length: the limit must hold while the body arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"z" * 8192
        yield b'"}'

    response = client.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_routes_methods_and_keys(server, client):
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/nothing").json()["error"]["code"] == "unknown_url"
    assert client.get(C).status_code == 405
    assert client.get(f"/v1/models/{server.model_name}").json()["id"] == server.model_name
    assert client.get("/v1/models/other").status_code == 404
    with server.client() as anonymous:
        anonymous.headers.pop("Authorization")
        for response in (anonymous.post(C, json={"prompt": "x"}), anonymous.post(C, content=b"{broken"),
                         anonymous.get("/v1/models")):
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        wrong = anonymous.post(C, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert anonymous.get("/health").status_code == 200  # probes need no key


def test_server_is_healthy_after_the_bad_inputs(server, client):
    assert client.get("/health").status_code == 200
    ok = client.post(C, json={"prompt": "still alive?", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.wait_idle()
