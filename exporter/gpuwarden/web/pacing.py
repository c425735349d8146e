"""Paced writes: an answer goes to the transport a chunk at a time, while its client reads.

The protocol (web/protocol.py) replaces its `transport` attribute with `paced_writes(...)`, so that it and uvicorn's
response cycles write through `PacedWrites`: a client that does not read holds at most the transport's limits
(`WRITE_HIGH_WATER_BYTES`, set on both layers of a TLS connection) and a view of the answer, and a response's head and
body leave in one send(). The TLS transport's layers are reached through asyncio internals (web/internals.py).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from gpuwarden.web.internals import TLS_PROTOCOL_TRANSPORT, TLS_TRANSPORT_PROTOCOL

WRITE_HIGH_WATER_BYTES = 16 * 1024  # unsent bytes at which a connection's writer is paused (TLS: each layer's)
PACE_CHUNK_BYTES = 16 * 1024  # handed to the transport at a time (PacedWrites) once the socket left some unsent
PACE_CHUNK_MAX_BYTES = 64 * 1024  # ... and while the socket takes each chunk whole (plain HTTP only)


class PacedWrites:
    """The connection's transport as the protocol and its response cycles see it: writes leave in the order made, a
    chunk at a time, and only while the client reads.

    asyncio's transports take whatever is written and keep what the socket does not: an answer of 100 KB to a client
    that does not read stayed as a copy in the socket transport's buffer and, over TLS, as ciphertext as well
    (~210 KiB a connection: 1,100 such clients OOM-killed a 256 MiB exporter). Here a write is kept as the caller's
    bytes (the exposition and the GPUs' JSON are shared by every request) and handed to the transport a chunk at a
    time until the transport pauses the writer (`paused`); the rest goes when it resumes (`flush`, from the
    protocol's resume_writing).

    What a transport copies is the part of a chunk the socket did not take. A chunk is `max_chunk` while the socket
    takes each one whole (a new connection's send buffer holds ~64 KiB even for a client that never reads, so a
    scrape of that size leaves in one send()), and `PACE_CHUNK_BYTES` after one it did not, until it takes one
    whole again. In 16 KiB pieces only, a 39 KB scrape took three send() calls and 30 % fewer requests a second;
    asking the kernel how full the socket is (TIOCOUTQ) cost 7 %. Over TLS `max_chunk` is `PACE_CHUNK_BYTES`:
    OpenSSL's memory BIO, into which asyncio encrypts, keeps the largest size it held (64 KiB chunks took 1,100
    never-reading TLS clients from 186 to 232 MiB).

    Writes smaller than a chunk are joined to what follows, so a response's status line and headers leave in the
    same send() as its body; a lone small write (`100 Continue`) leaves at the end of the loop iteration. close()
    closes the transport once everything is handed over, and stops reading meanwhile, as asyncio's close does."""

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        paused: Callable[[], bool],
        buffered: Callable[[], int] | None = None,
        max_chunk: int = PACE_CHUNK_MAX_BYTES,
    ) -> None:
        self._transport, self._loop, self._paused = transport, loop, paused
        self._buffered = buffered or transport.get_write_buffer_size
        self._max_chunk = max_chunk
        self._keeping_up = True  # the socket took the last chunk whole (a new connection's takes ~64 KiB)
        self._pending: collections.deque[bytes | memoryview] = collections.deque()
        self._pending_bytes = 0
        self._flush_scheduled = False
        self._close_requested = False
        self.aborted = False  # nothing more is written (abort(): the pipeline limit, a timeout, an eviction)

    def write(self, data: bytes | memoryview) -> None:
        if self.aborted or self._close_requested or not data:
            # asyncio's TLS transport raises AttributeError on a write after abort(): a traceback per connection
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= PACE_CHUNK_BYTES:
            # at once, so that a large answer pauses the writer before uvicorn completes the response (the next
            # pipelined request then waits for the reader: GuardedHttpProtocol.on_response_complete)
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def flush(self) -> None:
        """Hand the transport chunks until it pauses the writer or nothing is left; close it if asked and done."""
        transport = self._transport
        if self.aborted or transport.is_closing():
            self.discard()
            return
        while self._pending and not self._paused():
            transport.write(self._take(self._max_chunk if self._keeping_up else PACE_CHUNK_BYTES))
            if transport.is_closing():  # the write failed (a reset): asyncio closed the transport
                self.discard()
                return
            self._keeping_up = self._buffered() == 0  # the socket took it whole
        if self._close_requested and not self._pending:
            transport.close()

    def _take(self, limit: int) -> bytes | memoryview:
        """Up to `limit` bytes from the front: what was written, a slice of it, or small writes joined."""
        pending = self._pending
        first = pending[0]
        if len(first) >= limit or len(pending) == 1:
            if len(first) > limit:
                view = memoryview(first)
                first, pending[0] = view[:limit], view[limit:]
            else:
                pending.popleft()
            self._pending_bytes -= len(first)
            return first
        parts, size = [], 0
        while pending and size < limit:
            part = pending.popleft()
            if size + len(part) > limit:
                view = memoryview(part)
                part = view[: limit - size]
                pending.appendleft(view[limit - size :])
            parts.append(part)
            size += len(part)
        self._pending_bytes -= size
        return b"".join(parts)

    def discard(self) -> None:
        """Forget what is held (the connection is lost)."""
        self._pending.clear()
        self._pending_bytes = 0

    def close(self) -> None:
        if self._close_requested or self.aborted:
            return
        self._close_requested = True
        if self._pending and not self._transport.is_closing():
            self._transport.pause_reading()
        self.flush()

    def abort(self) -> None:
        self.aborted = True
        self.discard()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._close_requested or self.aborted or self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        """What the client has yet to be sent: held here and in the transport's buffer."""
        return self._pending_bytes + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def paced_writes(
    transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, paused: Callable[[], bool]
) -> PacedWrites:
    """A new connection's paced writes, with its transport's buffers limited (both layers of a TLS connection).

    asyncio's TLS transport lets the app write until 512 KiB per connection is encrypted and unsent
    (constants.FLOW_CONTROL_HIGH_WATER_SSL_WRITE) before it pauses it, and its socket transport beneath buffers
    64 KiB of ciphertext before it pauses the TLS layer: both get the plain limit, so a writer is paused with at most
    ~2 x WRITE_HIGH_WATER_BYTES unsent per connection (300 TLS clients that stopped reading held ~0.8 MiB each
    before)."""
    transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
    beneath = socket_transport_beneath(transport)
    if beneath is None:
        return PacedWrites(transport, loop, paused)
    beneath.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
    # TLS: chunks of one record (the memory BIO keeps the largest it held), both layers' buffers counted
    return PacedWrites(
        transport,
        loop,
        paused,
        lambda: transport.get_write_buffer_size() + beneath.get_write_buffer_size(),
        max_chunk=PACE_CHUNK_BYTES,
    )


def socket_transport_beneath(transport: asyncio.BaseTransport) -> asyncio.WriteTransport | None:
    """The socket transport under asyncio's TLS transport (`_SSLProtocolTransport._ssl_protocol._transport`, listed
    in web/internals.py); None for a plain connection."""
    protocol = getattr(transport, TLS_TRANSPORT_PROTOCOL, None)
    return getattr(protocol, TLS_PROTOCOL_TRANSPORT, None) if protocol is not None else None
