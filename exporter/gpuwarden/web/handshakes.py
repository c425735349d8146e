"""The TLS handshake gate: at most `ConnectionGuard.max_handshakes` TLS handshakes in progress, the rest waiting.

The gate is a task factory (`HandshakeLimiter`) that recognises asyncio's accept task, in which a handshake runs, by
its coroutine's name (web/internals.py lists it and the behaviour relied on); web/server.py installs it on a TLS
server's loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import Any

from gpuwarden.web.internals import ACCEPT_COROUTINE
from gpuwarden.web.limits import ConnectionGuard

# The grace a handshake's client has (ConnectionGuard.handshake_grace_s, 0.15 s and 0.5 s by default): a started
# handshake whose ClientHello is still incomplete after the first has stalled; one the server answered that the
# client has not finished after the second has stalled.
GRACE_CHECKS = 3  # ... and after this many admission checks: each is a turn of the loop, in which the handshake read
ADMISSION_CHECK_S = 0.05  # how often waiting handshakes are looked at while every slot is taken


class HandshakeLimiter:
    """At most `guard.max_handshakes` TLS handshakes in progress; the rest wait, newest first, before any TLS state.

    asyncio makes the protocol at accept but calls connection_made only after the TLS handshake, so a client that
    never finishes one costs memory (~100 KiB each) that the connection limit never sees: 4,500 of them took RSS up
    by 438 MiB. The handshake runs inside asyncio's accept task (`ACCEPT_COROUTINE`), which this task factory sees
    (`loop.set_task_factory`, public API) and runs behind an admission gate: a waiting connection is an accepted
    socket and a coroutine not yet started (no TLS state, a few KiB).

    A slot is taken from a handshake only when it has stalled: its ClientHello still incomplete the first of
    `ConnectionGuard.handshake_grace_s` after it started, or the server's answer unfinished by the client the
    second after it was sent, and in
    both cases `GRACE_CHECKS` admission checks later: the checks run on the loop, so a loop that lags under load
    (700 ms a turn under `wrk -c1000` on 2 cores) does not count its own lag against a client. Closing
    the oldest regardless let a probe through a flood of stalled handshakes, but 1,000 real clients connecting at
    once (`wrk -c1000`) then completed 0 requests: every handshake was closed before it could finish, and each client
    came back to be closed again. Waiting connections start newest first, so a probe starts as soon as a slot
    frees even behind a thousand waiting connections; one that waits past the header timeout, or past
    `4 × max_handshakes` waiting, is closed, oldest first. Whether the server has answered is the handshake's
    SSLObject having chosen a cipher (`SSLObject.cipher()`), seen by wrapping the context's `wrap_bio` (`watch`),
    which asyncio calls inside the accept task.
    """

    def __init__(self, guard: ConnectionGuard, clock: Callable[[], float] | None = None) -> None:
        self.guard = guard
        self.clock = clock
        self.running: dict[asyncio.Task[Any], _Handshake] = {}  # handshakes in progress, oldest first
        self.waiting: collections.deque[_Handshake] = collections.deque()  # accepted, not started, oldest first
        self._check: asyncio.TimerHandle | None = None
        self.checks = 0  # admission checks run by the timer: one per turn of the loop at most

    @property
    def max_waiting(self) -> int:
        return 4 * self.guard.max_handshakes

    def watch(self, context: ssl.SSLContext) -> None:
        """See each handshake's SSLObject: `context.wrap_bio` is wrapped on this one context object."""
        wrap_bio = context.wrap_bio

        def wrap_and_note(*args: Any, **kwargs: Any) -> ssl.SSLObject:
            sslobj = wrap_bio(*args, **kwargs)
            try:
                handshake = self.running.get(asyncio.current_task())  # type: ignore[arg-type]
            except RuntimeError:  # no running loop: not one of the server's handshakes
                handshake = None
            if handshake is not None:
                handshake.sslobj = sslobj
            return sslobj

        context.wrap_bio = wrap_and_note  # type: ignore[method-assign]

    def __call__(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if getattr(coro, "__qualname__", "") != ACCEPT_COROUTINE:
            return asyncio.Task(coro, loop=loop, **kwargs)
        handshake = _Handshake(self._now(loop), coro)
        handshake.task = asyncio.Task(self._admitted(handshake, loop), loop=loop, **kwargs)
        return handshake.task

    def _now(self, loop: asyncio.AbstractEventLoop) -> float:
        return self.clock() if self.clock is not None else loop.time()

    async def _admitted(self, handshake: _Handshake, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for a slot, then run asyncio's accept (the handshake) in it."""
        task = handshake.task
        try:
            if self.waiting or len(self.running) >= self.guard.max_handshakes:
                handshake.gate = loop.create_future()
                self.waiting.append(handshake)
                self._admit(loop)
                await handshake.gate
            else:
                self._start(handshake, loop)
        except asyncio.CancelledError:
            handshake.discard()  # closed before it started: asyncio's coroutine never ran to close its socket
            with contextlib.suppress(ValueError):  # cancelled from elsewhere (shutdown): no gate to open later
                self.waiting.remove(handshake)
            raise
        try:
            await handshake.coro
        finally:
            if self.running.pop(task, None) is not None and self.waiting:  # type: ignore[arg-type]
                self._admit(loop)

    def _start(self, handshake: _Handshake, loop: asyncio.AbstractEventLoop) -> None:
        handshake.started = self._now(loop)
        handshake.started_check = self.checks
        self.running[handshake.task] = handshake  # type: ignore[index]

    def _admit(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close what waited too long or stalled, and start the newest waiting handshakes in the slots free."""
        now = self._now(loop)
        while self.waiting and (
            len(self.waiting) > self.max_waiting or now - self.waiting[0].accepted > self.guard.header_timeout_s
        ):
            self._close(self.waiting.popleft().task)
        if self.waiting and len(self.running) >= self.guard.max_handshakes:
            grace = self.guard.handshake_grace_s
            stalled = [task for task, shake in self.running.items() if shake.stalled(now, self.checks, grace)]
            for task in stalled[: len(self.waiting)]:
                del self.running[task]
                self._close(task)
        while self.waiting and len(self.running) < self.guard.max_handshakes:
            handshake = self.waiting.pop()
            self._start(handshake, loop)
            handshake.gate.set_result(None)  # type: ignore[union-attr]
        if self.waiting and self._check is None:
            self._check = loop.call_later(ADMISSION_CHECK_S, self._recheck, loop)

    def _recheck(self, loop: asyncio.AbstractEventLoop) -> None:
        self._check = None
        self.checks += 1
        self._admit(loop)

    def _close(self, task: asyncio.Task[Any] | None) -> None:
        self.guard.reject("handshake_limit")
        if task is not None:
            task.cancel()


class _Handshake:
    """One accepted TLS connection: asyncio's accept coroutine, when it was accepted and started, its SSLObject,
    and when the server was first seen to have answered its ClientHello."""

    __slots__ = ("coro", "task", "gate", "accepted", "started", "started_check", "sslobj", "answered", "answered_check")

    def __init__(self, accepted: float, coro: Any) -> None:
        self.coro = coro
        self.task: asyncio.Task[Any] | None = None
        self.gate: asyncio.Future[None] | None = None
        self.accepted = accepted
        self.started = accepted
        self.started_check = 0
        self.sslobj: ssl.SSLObject | None = None
        self.answered: float | None = None
        self.answered_check = 0

    def stalled(self, now: float, checks: int, grace: tuple[float, float]) -> bool:
        """Whether the client, not the server, has kept this handshake from going on for its grace (unanswered,
        answered)."""
        if self.answered is None and self.sslobj is not None and self.sslobj.cipher() is not None:
            self.answered, self.answered_check = now, checks
        if self.answered is None:
            return now - self.started > grace[0] and checks - self.started_check >= GRACE_CHECKS
        return now - self.answered > grace[1] and checks - self.answered_check >= GRACE_CHECKS

    def discard(self) -> None:
        """Close the socket of an accept coroutine that never started (its own cleanup runs only once started)."""
        if self.coro.cr_frame is not None:
            conn = self.coro.cr_frame.f_locals.get("conn")
            if isinstance(conn, socket.socket):
                conn.close()
        self.coro.close()
