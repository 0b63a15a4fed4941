"""ASGI middleware: a request body size limit (HTTP 413, OpenAI error JSON) and request ids.

Pure ASGI rather than Starlette's `BaseHTTPMiddleware`, which buffers streaming responses. The
limit is enforced on the declared `Content-Length` and, for chunked uploads, on the bytes actually
received, so a huge body is refused before it is parsed. Every request gets an id (the client's
`X-Request-Id` or a fresh one), echoed in the response header and in one access-log line.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from clawflow.serving.protocol import error_body

log = logging.getLogger("clawflow.gateway.access")


class BodyLimitAndRequestIds:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        t0, status = time.perf_counter(), [0]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            declared = int(headers[b"content-length"]) if b"content-length" in headers else None
        except ValueError:
            declared = None
        if declared is not None and declared > self.max_bytes:
            await self._too_large(send_with_id)
        elif declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_capped(receive)  # chunked upload: buffer up to the limit, then replay
            if body is None:
                await self._too_large(send_with_id)
            else:
                replayed = [False]

                async def replay():
                    if replayed[0]:
                        return await receive()
                    replayed[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}

                await self.app(scope, replay, send_with_id)
        else:  # the server holds the body to its declared length
            await self.app(scope, receive, send_with_id)
        log.info("request_id=%s %s %s status=%s %.3fs", rid, scope["method"], scope["path"], status[0],
                 time.perf_counter() - t0)

    async def _read_capped(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send) -> None:
        body = json.dumps(error_body(f"Request body exceeds the limit of {self.max_bytes} bytes.",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
