"""web/internals.py is the one list of the uvicorn, asyncio, httptools, starlette and anyio internals web/ touches:
every row is still in the installed libraries, and web/'s sources touch none that is not listed.

What counts as touching an internal, read from each module's syntax tree (`unlisted_touches`):
- a dotted name outside a library's public API: a step that starts with `_`, or one missing from the `__all__` of
  the module it is looked up in (`asyncio.sslproto.SSLProtocol.max_size`, `from uvicorn.protocols... import X`);
- on a class of ours that subclasses a library class: every method it defines, and every attribute it reads or
  sets on `self` or `super()`, that the library class has (a class attribute, or one its source sets on `self`);
- on an object of a library class (a parameter annotated with one, a local made by calling one, an attribute whose
  row gives its type): a name that starts with `_`, and instance state the library's source sets on `self`;
- on an object of our subclass held elsewhere (`self.server = _Server(...)`, an annotated parameter): as on `self`.
Objects the scan cannot type (a loop variable, a call's result, `Any`) are not followed: they are named here so the
limit is known. Names reached by string (getattr, a coroutine's __qualname__) come from constants of
web/internals.py, which the module must import.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path
from typing import Any

from gpuwarden.web import internals
from gpuwarden.web.internals import INTERNALS, Internal, missing
from gpuwarden.web.internals import assigned_on_self as _assigned_on_self
from gpuwarden.web.internals import resolve as _resolve

WEB = Path(__file__).resolve().parent.parent / "exporter" / "gpuwarden" / "web"
LIBRARIES = ("uvicorn", "asyncio", "httptools", "starlette", "anyio", "fastapi")


resolve = functools.cache(_resolve)
assigned_on_self = functools.cache(_assigned_on_self)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


@functools.cache
def _canonical(path: str) -> str:
    """A row's or a touch's owner as where it is defined (uvicorn.Server is uvicorn.server.Server)."""
    found = resolve(path)
    if isinstance(found, type):
        return f"{found.__module__}.{found.__qualname__}"
    return getattr(found, "__name__", path) if found is not None else path


def _library_class(found: object) -> bool:
    return isinstance(found, type) and found.__module__.split(".")[0] in LIBRARIES


@functools.cache
def _private(path: str) -> bool:
    """Whether a dotted name leaves its library's public API (an `_` step, or a step not in a module's __all__)."""
    parts = path.split(".")
    current: Any = resolve(parts[0])
    for depth, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not _dunder(part):
            return True
        public = getattr(current, "__all__", None) if isinstance(current, type(ast)) else None
        if public is not None and part not in public:
            return True
        current = resolve(".".join(parts[: depth + 1]))
        if current is None:
            return True  # gone: only a listed row can say what it was
    return False


def _provides(cls: type, name: str) -> bool:
    return not _dunder(name) and (hasattr(cls, name) or name in assigned_on_self(cls))


def _state(cls: type, name: str) -> bool:
    """Instance state of a library class: set on `self` by its source, not a class attribute, or private."""
    return not _dunder(name) and (name.startswith("_") or (name in assigned_on_self(cls) and not hasattr(cls, name)))


@dataclasses.dataclass
class _Ours:
    """A class of the module: the library class it subclasses (if any), and its attributes made by a call."""

    name: str
    base: type | None
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Scan:
    """The library internals one module's source touches: (owner, name) pairs, and problems found on the way."""

    def __init__(self, source: str, rows: tuple[Internal, ...]) -> None:
        self.tree = ast.parse(source)
        self.row_types = {(_canonical(r.owner), r.name): r.type for r in rows}
        self.imports: dict[str, str] = {}
        self.ours: dict[str, _Ours] = {}
        self.touches: set[tuple[str, str]] = set()
        self.problems: list[str] = []
        self.parents = {child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}

    def run(self) -> _Scan:
        self._read_imports()
        self._read_classes()
        self._visit(self.tree, {}, None)
        return self

    def _touch(self, owner: str, name: str) -> None:
        self.touches.add((_canonical(owner), name))

    def _read_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in LIBRARIES:
                        local = alias.asname or alias.name.split(".")[0]
                        self.imports[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] not in LIBRARIES:
                    continue
                for alias in node.names:
                    path = f"{node.module}.{alias.name}"
                    self.imports[alias.asname or alias.name] = path
                    if _private(path):
                        self._touch(node.module, alias.name)

    def _dotted(self, node: ast.AST) -> str | None:
        """The library path a Name/Attribute chain spells, through the module's imports."""
        if isinstance(node, ast.Name):
            return self.imports.get(node.id)
        if isinstance(node, ast.Attribute) and (head := self._dotted(node.value)) is not None:
            return f"{head}.{node.attr}"
        return None

    def _class_of(self, node: ast.AST | None) -> Any:
        """A library class or one of ours that an annotation or a called name refers to."""
        if isinstance(node, ast.Subscript):
            return self._class_of(node.value)
        if isinstance(node, ast.BinOp):
            return self._class_of(node.left) or self._class_of(node.right)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self._class_of(ast.parse(node.value, mode="eval").body)
        if isinstance(node, ast.Name) and node.id in self.ours:
            return self.ours[node.id]
        path = self._dotted(node) if node is not None else None
        found = resolve(path) if path else None
        return found if _library_class(found) else None

    def _read_classes(self) -> None:
        for node in self.tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [self._class_of(base) for base in node.bases]
                base = next((b for b in bases if isinstance(b, type)), None)
                self.ours[node.name] = _Ours(node.name, base)
                if base is not None:
                    self._touch(base.__module__, base.__qualname__)
        for node in self.tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            for assign in ast.walk(node):
                if isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call):
                    made = self._class_of(assign.value.func)
                    for target in assign.targets:
                        is_self = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        if made is not None and is_self and target.value.id == "self":  # type: ignore[union-attr]
                            self.ours[node.name].attributes[target.attr] = made  # type: ignore[union-attr]

    def _type_of(self, node: ast.AST, env: dict[str, Any]) -> Any:
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if not isinstance(node, ast.Attribute):
            return None
        held = self._type_of(node.value, env)
        owner = held.base if isinstance(held, _Ours) else held
        if isinstance(held, _Ours) and node.attr in held.attributes:
            return held.attributes[node.attr]
        if isinstance(owner, type):
            declared = self.row_types.get((_canonical(f"{owner.__module__}.{owner.__qualname__}"), node.attr))
            found = resolve(declared) if declared else None
            return found if isinstance(found, type) else None
        return None

    def _visit(self, node: ast.AST, env: dict[str, Any], cls: _Ours | None) -> None:
        if isinstance(node, ast.ClassDef) and node.name in self.ours:
            cls = self.ours[node.name]
            for item in node.body:
                method = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                if method and cls.base is not None and _provides(cls.base, item.name):  # type: ignore[union-attr]
                    self._touch(f"{cls.base.__module__}.{cls.base.__qualname__}", item.name)  # type: ignore[union-attr]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            env = dict(env)
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for position, arg in enumerate(arguments):
                env[arg.arg] = self._class_of(arg.annotation)
                if position == 0 and cls is not None and not isinstance(node, ast.Lambda) and arg.arg == "self":
                    env["self"] = cls
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            made = self._class_of(node.value.func)
            for target in node.targets:
                if isinstance(target, ast.Name) and made is not None:
                    env[target.id] = made
        if isinstance(node, ast.Attribute):
            self._attribute(node, env, cls)
        for child in ast.iter_child_nodes(node):
            self._visit(child, env, cls)

    def _attribute(self, node: ast.Attribute, env: dict[str, Any], cls: _Ours | None) -> None:
        parent = self.parents.get(node)
        path = self._dotted(node)
        if path is not None:
            if not (isinstance(parent, ast.Attribute) and parent.value is node) and _private(path):
                owner, _, name = path.rpartition(".")
                self._touch(owner, name)
            return
        value = node.value
        is_super = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
        held = cls if is_super else self._type_of(value, env)
        base = held.base if isinstance(held, _Ours) else None
        if base is not None and node.attr not in held.attributes and _provides(base, node.attr):
            owner = f"{base.__module__}.{base.__qualname__}"
            self._touch(owner, node.attr)
            chained = isinstance(parent, ast.Attribute) and parent.value is node
            if chained and self.row_types.get((_canonical(owner), node.attr)) == "" and not hasattr(base, node.attr):
                self.problems.append(f"{owner}.{node.attr}: give its row a type, so that .{parent.attr} is checked")
        elif isinstance(held, type) and _library_class(held) and _state(held, node.attr):
            self._touch(f"{held.__module__}.{held.__qualname__}", node.attr)


def unlisted_touches(sources: dict[str, str], rows: tuple[Internal, ...] = INTERNALS) -> list[str]:
    """Each internal a module touches that `rows` does not list for it (module name → its source), and each row of a
    kind that names a touch that no module touches, by syntax or through a constant of web/internals.py."""
    listed = {(_canonical(row.owner), row.name): row for row in rows}
    problems: list[str] = []
    touched: set[tuple[str, str]] = set()
    for module, source in sorted(sources.items()):
        scan = _Scan(source, rows).run()
        problems += [f"{module}: {problem}" for problem in scan.problems]
        for owner, name in sorted(scan.touches):
            row = listed.get((owner, name))
            if row is None:
                problems.append(f"{module}: touches {owner}.{name}, which web/internals.py does not list")
            elif module not in row.used_by.split(", "):
                problems.append(f"{module}: touches {owner}.{name}, listed as used by {row.used_by} only")
            touched.add((owner, name))
    by_name = {
        constant: value
        for constant, value in vars(internals).items()
        if constant.isupper() and isinstance(value, str) and not constant.startswith("_")
    }
    for key, row in listed.items():
        if row.kind == "behaviour" or key in touched or row.used_by not in sources:
            continue
        constants = [constant for constant, value in by_name.items() if value.split(".")[-1] == row.name]
        user = sources.get(row.used_by, "")
        if not any(constant in user for constant in constants):
            problems.append(f"{row.owner}.{row.name}: listed, but {row.used_by} neither touches it nor names it")
    return problems


def _web_sources() -> dict[str, str]:
    modules = sorted(path for path in WEB.glob("*.py") if path.stem != "internals")
    return {path.stem: path.read_text(encoding="utf-8") for path in modules}


def test_every_listed_internal_is_in_the_installed_libraries():
    assert missing() == []
    assert len(INTERNALS) > 40, "the list was emptied: this check would pass over nothing"


def test_a_row_the_libraries_no_longer_have_is_reported():
    gone = (
        Internal("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "on_gone", "method", "protocol", "-"),
        Internal("uvicorn.protocols.http.flow_control.FlowControl", "paused_for_ever", "state", "protocol", "-"),
        Internal("asyncio.sslproto.SSLProtocol", "__init__", "behaviour", "handshakes", "-", expects=("no such",)),
        Internal("asyncio.selector_events.BaseSelectorEventLoop", "_accept_connection", "coroutine", "x", "-"),
        Internal("uvicorn.gone_module", "Anything", "imported", "protocol", "-"),
    )
    problems = missing(gone)
    assert [p.split(":")[0] for p in problems] == [f"{row.owner}.{row.name}" for row in gone], problems
    assert "no longer holds ['no such']" in problems[2] and "not the coroutine" in problems[3], problems


def test_web_touches_no_internal_the_list_does_not_name():
    sources = _web_sources()
    assert {"protocol", "pacing", "handshakes", "server", "limits"} <= set(sources), sorted(sources)
    assert unlisted_touches(sources) == []


PLANTED = """
import asyncio
import asyncio.base_events
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class Planted(HttpToolsProtocol):
    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self.scope.clear()


class Served(uvicorn.Server):
    pass


def tune(cycle: RequestResponseCycle) -> None:
    asyncio.base_events._MIN_SCHEDULED_TIMER_HANDLES = 1
    cycle.more_body = False
    server = Served(uvicorn.Config(app=None))
    server.force_exit = True
    config = uvicorn.Config(app=None)
    config.load()
"""


def test_a_planted_touch_of_an_unlisted_internal_is_caught():
    """Each kind of touch the scan knows, planted in a module; the listed ones and the public API pass."""
    problems = unlisted_touches({"protocol": PLANTED})
    unlisted = sorted(p.split(" touches ")[1].split(",")[0] for p in problems if "does not list" in p)
    assert unlisted == [
        "asyncio.base_events._MIN_SCHEDULED_TIMER_HANDLES",  # a private name of a private module
        "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol.on_url",  # a method of the subclassed class
        "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol.scope",  # its state
        "uvicorn.protocols.http.httptools_impl.RequestResponseCycle",  # imported from a private module
        "uvicorn.protocols.http.httptools_impl.RequestResponseCycle.more_body",  # state of an annotated parameter
        "uvicorn.server.Server.force_exit",  # state of an object of our subclass, made by a call
    ], problems  # and uvicorn.Config(...).load(), public, is not a touch
    assert "protocol: touches uvicorn.server.Server, listed as used by server only" in problems, problems
    # the type of a chained state attribute must be declared, or its chain would go unseen
    scope = Internal("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "scope", "state", "protocol", "-")
    untyped = unlisted_touches({"protocol": PLANTED}, (*INTERNALS, scope))
    assert any("HttpToolsProtocol.scope: give its row a type, so that .clear is checked" in p for p in untyped)
    typed = unlisted_touches({"protocol": PLANTED}, (*INTERNALS, dataclasses.replace(scope, type="builtins.dict")))
    assert not any("give its row a type" in p for p in typed), typed
    # a row no module touches any more is reported
    stale = (*INTERNALS, Internal("uvicorn.Server", "install_signal_handlers", "method", "server", "-"))
    assert unlisted_touches(_web_sources(), stale) == [
        "uvicorn.Server.install_signal_handlers: listed, but server neither touches it nor names it"
    ]
