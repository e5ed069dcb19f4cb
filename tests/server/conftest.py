"""Live `dspark-serve` apps on 127.0.0.1, each in a thread of this process, on an ephemeral port.

Every server builds its own random-tiny model and engine (two engines never share a model across
threads), serves until its fixture ends, and stops within a bounded time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from importlib import resources

import dspark
from dspark.engine import Engine, EngineConfig
from dspark.tokenizer import ByteTokenizer
from dspark_server import create_app
from dspark_server.__main__ import RANDOM_TINY, load_model

API_KEY = "test-key"
MODEL = "tiny-test"


def _without_eos():
    """random-tiny with no EOS token: every request runs to its max_tokens, whatever the weights,
    so tests that need requests still running when they act do not depend on where EOS falls."""
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    model = dspark.init_model({**config, "eos_token_id": None}, seed=0)
    model.tokenizer = ByteTokenizer(config["vocab_size"])
    return model


class LiveServer:
    """`create_app(...)` under uvicorn in a daemon thread; `url`, `engine` and `async_engine`."""

    def __init__(self, api_key: str | None = API_KEY, drain_s: float = 5.0, max_body_bytes: int = 64 * 1024,
                 eos: bool = True, **engine_config):
        self.model = load_model(RANDOM_TINY, "cpu") if eos else _without_eos()
        self.engine = Engine(self.model, EngineConfig(**engine_config))
        self.app = create_app(self.engine, model_name=MODEL, api_key=api_key, drain_s=drain_s,
                              max_body_bytes=max_body_bytes)
        self.async_engine = self.app.state.async_engine
        self.api_key, self.model_name = api_key, MODEL
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=10))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start within 30 s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=20)
        self._sock.close()
        assert not self._thread.is_alive(), "server thread did not stop"

    def run_in_loop(self, coro, timeout: float = 30):
        """Run `coro` on the server's event loop (the only thread allowed to touch its engine)."""
        loop = self.async_engine._task.get_loop()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def client(self, timeout: float = 60, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout, **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once no request is in flight in the bridge or the engine (read on the loop thread)."""
        async def busy():
            return self.async_engine.in_flight > 0 or self.engine.has_work()

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run_in_loop(busy()):
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="session")
def server():
    """The shared server: n-gram drafting with 3 verified drafts, so speculative metrics move."""
    live = LiveServer(max_running=16, max_waiting=64, max_prompt_tokens=256, max_new_tokens=512,
                      draft_tokens=3, drafter="ngram").start()
    yield live
    live.stop()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture
def make_server():
    """Start extra servers with their own limits (`LiveServer` keyword arguments); all stop at the
    end of the test."""
    started = []

    def make(**kwargs) -> LiveServer:  # e.g. eos=False, max_running=1
        started.append(LiveServer(**kwargs).start())
        return started[-1]

    yield make
    for live in started:
        live.stop()
