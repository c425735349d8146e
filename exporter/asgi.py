"""ASGI pieces both HTTP apps share (the exporter's and the fleet service's): JSON problems, validation errors as
plain data, and the request-header size limit. Imports nothing of the poller, NVML or Prometheus, and FastAPI only
when a helper that builds its objects runs."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # FastAPI is imported by the apps that use these helpers, not by the exporter's front
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

MAX_HEADER_BYTES = 16 * 1024


def problem(status: int, error: str, detail: Any = None) -> JSONResponse:
    """A 4xx/5xx answer as JSON: one line saying what was wrong, and optional detail."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": error, "detail": detail}, status_code=status)


def jsonable_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """A validation error's locations and messages, without the input echoed back."""
    return [{"loc": [str(part) for part in err.get("loc", ())], "msg": err.get("msg", "")} for err in exc.errors()]


def first_error(exc: RequestValidationError) -> str:
    """'invalid <where>: <what>' for the first validation error."""
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ()))
    return f"invalid {where}: {first.get('msg', 'bad request')}"


class HeaderLimit:
    """Refuse requests whose headers exceed 16 KiB with 431 JSON: a second line behind exporter/httpserver.py's
    own limit, and the limit for an app served by another ASGI server."""

    def __init__(self, app: Any, limit: int = MAX_HEADER_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > self.limit:
            body = json.dumps({"error": f"request headers exceed {self.limit} bytes"}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 431,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
