"""A share of a listener per peer address, so that one address cannot take the connections another needs.

On the probe listener every pod can connect, and the kubelet probes from the node's address. 1,000 connections from
another address that each sent one byte and then nothing (past the kernel's wait for data, web/probes.py) held the
listener's 64 connections between them and kept it evicting: 33 of 118 probes failed, 9 in a row
(bench/probes_under_load.py idle --source 127.0.0.2 --first G). With a share, a newcomer from an address that already
holds `max_per_peer` connections is refused at once, unless its socket already holds the start of a probe's request
(the kubelet sends it as soon as it has connected): then the oldest of that address's own connections waiting for a
request with nothing unread makes room. So the kubelet's probes never lose a connection to another address, and an
attacker that shares the kubelet's address (a host-network pod) cannot keep a probe out with connections that have
not asked for one. Refusing costs the server little (making room for every newcomer instead let that flood fail 52
of 105 probes: each newcomer admitted was read and timed, and the accept queue grew).

`SharedListener` counts a connection in when it accepts it (asyncio accepts a burst of them before any one's
protocol starts), web/protocol.py's GuardedHttpProtocol counts it out (`connection_lost`) and, for one that asked
for a probe past its share, makes room (`make_room`).
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

PROBE_REQUESTS = (b"GET /healthz ", b"GET /readyz ", b"HEAD /healthz ", b"HEAD /readyz ")


class PeerShares:
    """Open connections per peer address, and the room one address may take."""

    def __init__(self, max_per_peer: int) -> None:
        self.max_per_peer = max_per_peer
        self.open: Counter[str] = Counter()

    def add(self, peer: str) -> None:
        self.open[peer] += 1

    def remove(self, peer: str) -> None:
        if self.open[peer] <= 1:
            self.open.pop(peer, None)
        else:
            self.open[peer] -= 1

    def over(self, peer: str) -> bool:
        """Whether `peer`, counted with its newcomer, holds more than its share."""
        return self.open[peer] > self.max_per_peer

    def make_room(self, newcomer: Any, waiting: Iterable[Any], evictable: Callable[[Any], bool]) -> Any | None:
        """The connection to close for `newcomer` (a protocol with `peer`) when its peer is past its share: the oldest
        of `waiting` (connections waiting for a request, oldest first) from the same peer that `evictable` allows;
        None when the peer is within its share or none can go. Such a newcomer has asked for a probe: the others
        were refused at accept."""
        if not self.over(newcomer.peer):
            return None
        return next((c for c in waiting if c is not newcomer and c.peer == newcomer.peer and evictable(c)), None)


def asks_for_a_probe(sock: socket.socket) -> bool:
    """Whether the bytes waiting in a plain connection's socket, not read yet, begin a probe's request (MSG_PEEK)."""
    try:
        start = sock.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    return start.startswith(PROBE_REQUESTS)


class SharedListener(socket.socket):
    """A listening socket whose accept() closes, at once, each connection from a peer that holds its share and has
    not asked for a probe: no transport, no protocol, no timer is made for it (asyncio's accept calls it in a loop,
    and a refusal costs a few microseconds instead of a connection's setup and teardown, so the accept queue, in
    which a probe waits behind the flood, drains fast)."""

    peers: PeerShares
    on_refuse: Callable[[], None]

    @classmethod
    def around(cls, sock: socket.socket, peers: PeerShares, on_refuse: Callable[[], None]) -> SharedListener:
        """This listener in place of `sock` (which is detached: its descriptor is this one's)."""
        listener = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        listener.peers, listener.on_refuse = peers, on_refuse
        return listener

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            conn, address = super().accept()  # BlockingIOError when none is left: asyncio's loop stops there
            peer = address[0] if isinstance(address, tuple) else ""
            if self.peers.open[peer] < self.peers.max_per_peer or asks_for_a_probe(conn):
                self.peers.add(peer)
                return conn, address
            self.on_refuse()
            conn.close()
