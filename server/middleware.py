"""Pure-ASGI guards that run before routing: API key, then request body size.

They are ASGI rather than FastAPI dependencies so that they answer before the body is parsed: an
unauthenticated client gets a 401 even when its JSON is malformed, and an oversized body is refused
without being buffered whole.
"""

from __future__ import annotations

import hmac

from .errors import APIError, error_response


class ApiKeyAuth:
    """Requires `Authorization: Bearer <key>` on /v1/ routes (health, metrics and docs stay open,
    as in vLLM, so probes and scrapers need no secret)."""

    def __init__(self, app, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            # compare_digest: the time taken must not reveal how much of the key matched.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                error = APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)")
                await error_response(error, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses request bodies over `max_bytes` with 413, whether Content-Length announces them or a
    chunked upload only reveals it while arriving; the accepted body is replayed to the app, and
    later `receive` calls (disconnect detection while streaming) go to the server."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        error = APIError(413, f"request body exceeds {self.max_bytes} bytes")
        await error_response(error, headers={"Connection": "close"})(scope, receive, send)
