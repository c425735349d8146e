"""Every uvicorn, asyncio and starlette internal that web/ touches, as data: what, where, why, and how to check it.

uvicorn documents no way to subclass its protocol or server, and asyncio none to reach under its TLS transport or
into its accept task; web/ does all of these (web/pacing.py, web/handshakes.py, web/protocol.py, web/server.py,
web/limits.py), and web/api.py subclasses starlette's Response. `INTERNALS` names each internal once: the library
object it belongs to (`owner`), the name touched, its kind (`KINDS`), the web/ module that touches it and why.
`missing()` checks them against the installed libraries; tests/test_web_internals.py runs it, and also reads web/'s
sources and fails when a module touches an internal of uvicorn, asyncio, httptools, starlette, anyio or fastapi that
is not listed here (the rules are in its docstring), so an upgrade that drops one fails a test rather than a node,
and a new one cannot go unlisted.
"""

from __future__ import annotations

from dataclasses import dataclass

# what a row's kind says is there (`missing` checks exactly this):
KINDS = {
    "subclassed": "a class web/ subclasses (its name and methods are then the library's contract with us)",
    "imported": "a name imported from a module outside the library's public API",
    "method": "a method web/ overrides or calls on the library's object",
    "state": "an instance attribute the library sets (`self.name = ...` in its source) that web/ reads or replaces",
    "setting": "a module or class attribute web/ assigns (a process-wide setting asyncio has no API for)",
    "coroutine": "a coroutine web/ recognises by its __qualname__",
    "behaviour": "no name touched: the library's code there does what web/ relies on (`expects` in its source)",
}


@dataclass(frozen=True)
class Internal:
    """One internal: `owner.name` in the installed library, touched by web/`used_by`.py for `why`."""

    owner: str  # dotted path of the library module or class (as web/ reaches it)
    name: str
    kind: str  # a key of KINDS
    used_by: str  # the module of web/ that touches it
    why: str
    type: str = ""  # state only: its value's class, so the source check follows chains (self.flow.write_paused)
    expects: tuple[str, ...] = ()  # snippets the source of owner.name must hold: the behaviour relied on


_PROTOCOL = "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"
_CYCLE = "uvicorn.protocols.http.httptools_impl.RequestResponseCycle"
_FLOW = "uvicorn.protocols.http.flow_control.FlowControl"
_TLS_TRANSPORT = "asyncio.sslproto._SSLProtocolTransport"
_TLS_PROTOCOL = "asyncio.sslproto.SSLProtocol"
_SELECTOR_LOOP = "asyncio.selector_events.BaseSelectorEventLoop"
_SERVER = "uvicorn.Server"

# the names web/ reaches by string (getattr, a coroutine's __qualname__); their rows are below
TLS_TRANSPORT_PROTOCOL = "_ssl_protocol"  # asyncio's TLS transport → its TLS protocol
TLS_PROTOCOL_TRANSPORT = "_transport"  # ... → the socket transport beneath
_ACCEPT = "_accept_connection2"
ACCEPT_COROUTINE = f"{_SELECTOR_LOOP.rpartition('.')[2]}.{_ACCEPT}"  # the accept task's coroutine, the handshake inside


def _protocol_method(name: str, why: str, *expects: str) -> Internal:
    return Internal(_PROTOCOL, name, "method", "protocol", why, expects=expects)


def _protocol_state(name: str, why: str, value_type: str = "") -> Internal:
    return Internal(_PROTOCOL, name, "state", "protocol", why, type=value_type)


INTERNALS: tuple[Internal, ...] = (
    # web/protocol.py: GuardedHttpProtocol, uvicorn's httptools protocol with gpuwarden's limits
    Internal("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol", "subclassed", "protocol", "the protocol"),
    Internal(
        "uvicorn.protocols.http.flow_control",
        "service_unavailable",
        "imported",
        "protocol",
        "the 503 app uvicorn answers with past its own concurrency limit; ours sheds through it",
    ),
    _protocol_method("connection_made", "limits both TLS layers, paces writes, sets TCP_NODELAY, admits"),
    _protocol_method("connection_lost", "counts the connection out: peer share, deadlines, aborting"),
    _protocol_method(
        "data_received",
        "counts request bytes as they arrive (431/413); uvicorn logs each malformed request (quieted)",
        "Invalid HTTP request received.",
    ),
    _protocol_method("on_message_begin", "a pipelined request parsed from the same read gets its own deadline"),
    _protocol_method(
        "on_headers_complete",
        "refusals before uvicorn makes the cycle; the cycle writes through the protocol's transport (paced) and "
        "runs the protocol's app (swapped for the 503)",
        "transport=self.transport",
        "app = self.app",
    ),
    _protocol_method("on_body", "a refused request's rest is dropped, not handed to a missing cycle"),
    _protocol_method("on_message_complete", "the next pipelined request counts its bytes from here"),
    _protocol_method("on_response_complete", "the next pipelined request waits while the client does not read"),
    _protocol_method("send_400_response", "counts the refusal (bad_request)"),
    _protocol_method("pause_writing", "starts the write timeout; parks the request"),
    _protocol_method("resume_writing", "hands the paced writes on; starts a held pipelined request"),
    Internal(
        _PROTOCOL,
        "_unsupported_upgrade_warning",
        "behaviour",
        "protocol",
        "uvicorn logs each unsupported upgrade through the protocol's logger, which ours quiets",
        expects=('self.logger.warning("Unsupported upgrade request.")',),
    ),
    _protocol_state(
        "transport", "replaced by the paced writes: its and its cycles' writes go through them", "asyncio.Transport"
    ),
    _protocol_state("logger", "replaced by a logger that drops uvicorn's line per malformed request"),
    _protocol_state("app", "swapped for service_unavailable while one request is refused with 503"),
    _protocol_state("loop", "the deadlines' timers", "asyncio.AbstractEventLoop"),
    _protocol_state("client", "the peer address: its share of the probe listener"),
    _protocol_state("cycle", "the newest request's response: complete or not (parked writer)", _CYCLE),
    _protocol_state("pipeline", "requests queued behind the one answered: at most MAX_PIPELINE"),
    _protocol_state("tasks", "the server's running requests (shedding past max_requests)"),
    _protocol_state("connections", "the server's open connections (admission at the limit)"),
    _protocol_state("flow", "whether the writer is paused (paced writes, parked writers)", _FLOW),
    _protocol_state("url", "the request's path: probes and the scrape are never shed", "builtins.bytes"),
    _protocol_state("headers", "the request's headers: their size, its content-length"),
    Internal(_FLOW, "write_paused", "state", "protocol", "the transport paused the writer: the client is not reading"),
    Internal(_CYCLE, "response_complete", "state", "protocol", "a request's answer is done: no task runs for it"),
    Internal(
        _CYCLE,
        "send",
        "behaviour",
        "protocol",
        "a request whose client does not read waits here, holding a task: counted as parked, not as load",
        expects=("await self.flow.drain()",),
    ),
    # web/pacing.py: the socket transport beneath asyncio's TLS transport, whose buffer is limited too
    Internal(_TLS_TRANSPORT, TLS_TRANSPORT_PROTOCOL, "state", "pacing", "its TLS protocol", type=_TLS_PROTOCOL),
    Internal(_TLS_PROTOCOL, TLS_PROTOCOL_TRANSPORT, "state", "pacing", "the socket transport beneath the TLS layer"),
    # web/handshakes.py: TLS handshakes in progress, bounded inside asyncio's accept task
    Internal(
        _SELECTOR_LOOP,
        _ACCEPT,
        "coroutine",
        "handshakes",
        "each accepted connection's task runs it, the TLS handshake inside; cancelled, it closes the transport; "
        "never started, its socket is found as its local `conn`",
        expects=("conn, extra", "_make_ssl_transport(", "await waiter", "transport.close()"),
    ),
    Internal(
        _SELECTOR_LOOP,
        "_accept_connection",
        "behaviour",
        "handshakes",
        "the accept coroutine runs as a task, which the limiter's task factory sees",
        expects=("self.create_task(accept)",),
    ),
    Internal(
        _TLS_PROTOCOL,
        "__init__",
        "behaviour",
        "handshakes",
        "the handshake's SSLObject comes from the server context's wrap_bio, inside the accept task",
        expects=("self._sslcontext.wrap_bio(",),
    ),
    # web/limits.py: what a TLS connection costs before its first byte of HTTP
    Internal(_TLS_PROTOCOL, "max_size", "setting", "limits", "the receive buffer given each TLS connection"),
    Internal("asyncio.constants", "SSL_HANDSHAKE_TIMEOUT", "setting", "limits", "the handshake's deadline"),
    # web/server.py: uvicorn's server, over our listener, with our TLS context and our signal handling
    Internal("uvicorn.server", "Server", "subclassed", "server", "the server: lifecycle, lifespan, graceful shutdown"),
    Internal(_SERVER, "serve", "method", "server", "runs the server over the listener already bound"),
    Internal(_SERVER, "startup", "method", "server", "starts the handshake limiter, sweep and heartbeat"),
    Internal(_SERVER, "handle_exit", "method", "server", "SIGTERM exits 0: the signal is not raised again"),
    Internal(
        _SERVER,
        "_captured_signals",
        "state",
        "server",
        "cleared so uvicorn does not raise them again once stopped",
        type="builtins.list",
    ),
    Internal(_SERVER, "should_exit", "state", "server", "set to stop the server (stop())"),
    Internal(_SERVER, "config", "state", "server", "the TLS context the startup reads", type="uvicorn.Config"),
    Internal(
        _SERVER,
        "server_state",
        "state",
        "server",
        "the open connections, for the close sweep",
        type="uvicorn.server.ServerState",
    ),
    Internal("uvicorn.server.ServerState", "connections", "state", "server", "the open protocols the sweep reads"),
    Internal("uvicorn.Config", "ssl", "state", "server", "our TLS context (uvicorn builds one only from paths)"),
    Internal(
        _SERVER,
        "_serve",
        "behaviour",
        "server",
        "a config already loaded is not loaded again, so the TLS context set after load() stays",
        expects=("if not config.loaded:",),
    ),
)

# web/api.py: the JSON API's own response class and error handler, on starlette's objects
_RESPONSE = "starlette.responses.Response"
INTERNALS += (
    Internal("starlette.responses", "Response", "subclassed", "api", "PartsResponse: a body sent as its parts"),
    Internal(_RESPONSE, "status_code", "state", "api", "PartsResponse sends the head itself"),
    Internal(_RESPONSE, "raw_headers", "state", "api", "PartsResponse sends the head itself (content-length set)"),
    Internal("starlette.exceptions.HTTPException", "status_code", "state", "api", "errors as JSON (documented)"),
    Internal("starlette.exceptions.HTTPException", "detail", "state", "api", "errors as JSON (documented)"),
)


def missing(internals: tuple[Internal, ...] = INTERNALS) -> list[str]:
    """The rows the installed libraries no longer have, as `owner.name: what is wrong` (none: all there)."""
    return [f"{row.owner}.{row.name}: {problem}" for row in internals if (problem := _problem(row))]


def _problem(row: Internal) -> str:
    """What is wrong with one row in the installed libraries ("" when nothing is)."""
    import inspect

    if row.kind not in KINDS:
        return f"unknown kind {row.kind!r}"
    owner = resolve(row.owner)
    if owner is None:
        return f"{row.owner} is gone"
    if row.kind == "state":
        found = hasattr(owner, row.name) or row.name in assigned_on_self(owner)
    else:
        found = row.name in getattr(owner, "__dict__", {}) or hasattr(owner, row.name)
    if not found:
        return f"no {row.kind} {row.name!r}"
    member = getattr(owner, row.name, None)
    if row.kind == "subclassed" and not isinstance(member, type):
        return "not a class"
    if row.kind == "coroutine":
        qualname = getattr(member, "__qualname__", "")
        if qualname != f"{owner.__qualname__}.{row.name}" or not inspect.iscoroutinefunction(member):
            return f"not the coroutine {owner.__qualname__}.{row.name} ({qualname})"
    if row.expects:
        try:
            source = inspect.getsource(member)  # type: ignore[arg-type]
        except (OSError, TypeError):
            return "no source to read"
        if lost := [snippet for snippet in row.expects if snippet not in source]:
            return f"no longer holds {lost}"
    return ""


def resolve(path: str) -> object | None:
    """The object at a dotted path (a module, then attributes), or None."""
    import importlib

    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            if not hasattr(found, part):
                return None
            found = getattr(found, part)
        return found
    return None


def assigned_on_self(cls: object) -> set[str]:
    """Attributes the source of a class and its bases assigns on `self` (its instances' state)."""
    import inspect
    import re

    names: set[str] = set()
    for klass in getattr(cls, "__mro__", ()):
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names.update(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))
    return names
