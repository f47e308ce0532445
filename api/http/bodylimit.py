"""The request body limit: a body larger than ``max_bytes`` is answered 413 before the application sees
any of it. A ``Content-Length`` over the limit is refused at once; a body without one (chunked transfer
encoding) is read only up to the limit, so a client cannot make the service buffer or parse more than
``max_bytes`` of one request."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http.problems import problem_response


class BodyLimit:
    """ASGI middleware: requests whose body exceeds ``max_bytes`` get a 413 problem (``too-large``)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, f"the body declares {int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:  # read the body (at most max_bytes of it) before the application parses anything
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the application see it
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, f"the body exceeds {self.max_bytes} bytes")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        response = problem_response(Request(scope), 413, "too-large", "Request body too large",
                                    f"{what}; this service accepts at most {self.max_bytes} bytes "
                                    "(FOLDTUNE_MAX_BODY_BYTES)", headers={"Connection": "close"})
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then whatever the server sends next (a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
