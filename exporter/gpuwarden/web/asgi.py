"""ASGI pieces both HTTP apps share (the exporter's and the fleet service's): JSON problems and validation errors as
plain data. Imports nothing of the poller, NVML or Prometheus, and FastAPI only when a helper that builds its
objects runs. (The request-header limit is the server's: exporter/gpuwarden/web/limits.py, enforced by
exporter/gpuwarden/web/protocol.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # FastAPI is imported by the apps that use these helpers, not by the exporter's front
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse


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
