"""Deadlines for slow clients: uvicorn's h11 protocol with a header and a body deadline.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and caps the header size
(h11's `max_incomplete_event_size`), but a client that sends its request a byte at a time is
never cut: the keep-alive timer stops at the first byte, and nothing bounds how long the headers
or the body may take. Each such connection keeps a socket, a file descriptor and (once its headers
are in) a handler waiting on the body, forever. Here the headers of each request must be complete
within `serve.header_timeout_s` of the connection opening (or the previous response ending), and
its body within `serve.body_timeout_s` of the headers; past either the client gets a 408 and the
connection is closed, and a handler waiting on the body sees a disconnect. The engine never waits
on a client: a request reaches the scheduler only once its body is in.

Its own module because it is transport, not API: `serving.app.make_server` hands the class to uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dvi.metrics import HTTP_PHASES

log = logging.getLogger("dvi.serving.connection")

_TIMEOUT_BODY = json.dumps({"error": {"message": "request not received in time", "type": "invalid_request_error",
                                      "param": None, "code": "request_timeout"}}).encode()
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n" % len(_TIMEOUT_BODY)) + _TIMEOUT_BODY


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol whose requests must arrive within `header_timeout_s` (headers) and `body_timeout_s`
    (body); see the module docstring. Subclassed per server by `deadline_protocol`."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    timeouts: dict[str, int] = {"headers": 0, "body": 0}  # connections cut, per phase (this server's class)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._partial = False  # bytes of a request arrived since its header deadline was armed

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        self._partial = False
        if phase is not None:
            seconds = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _follow(self) -> None:
        """Arm the deadline the request's state calls for (h11's view of the client)."""
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.our_state in (h11.IDLE, h11.DONE):
            self._arm("headers")
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:
            self._arm(None)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()
        self._partial = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()  # the next request's headers run against a fresh deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _expired(self, phase: str) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        if phase == "headers" and not self._partial:
            self.transport.close()  # an idle keep-alive connection: closed without a word, as uvicorn does
            return
        self.timeouts[phase] += 1
        log.info("closing a connection from %s: request %s not received within %gs", self.client, phase,
                 self.header_timeout_s if phase == "headers" else self.body_timeout_s)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            started = cycle.response_started
            cycle.disconnected = True  # the handler's receive() now answers http.disconnect; its send is dropped
            cycle.message_event.set()
            if not started:
                self.transport.write(TIMEOUT_RESPONSE)
        else:
            self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()


def deadline_protocol(header_timeout_s: float, body_timeout_s: float) -> type[DeadlineH11Protocol]:
    """A `DeadlineH11Protocol` class with these deadlines (uvicorn instantiates it per connection)."""
    return type("ServerH11Protocol", (DeadlineH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s),
                 "timeouts": dict.fromkeys(HTTP_PHASES, 0)})


class HeaderLimit:
    """ASGI middleware: a request whose request line and headers exceed `max_bytes` gets a 431.

    h11's `max_incomplete_event_size` only bounds headers that arrive in pieces; a request that
    arrives whole is parsed at any size. This bounds both (uvicorn gets the same number).
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
                len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.max_bytes:
                body = json.dumps({"error": {"message": f"request headers exceed {self.max_bytes} bytes",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "headers_too_large"}}).encode()
                await send({"type": "http.response.start", "status": 431,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

