"""pydantic's validation errors as one line naming the key, for the models that stay on pydantic.

They are the simulator's scenarios. The exporter's and the fleet service's settings use
exporter/gpuwarden/config/typed.py and never import this."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError


def describe_error(exc: ValidationError, source: str, root: type[BaseModel]) -> str:
    """Phrase the first pydantic error as one line: which key, what is wrong, what is allowed."""
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(_model_at(root, err["loc"][:-1]).model_fields)
        return f"{source}: unknown key '{key}'; allowed here: {allowed}"
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    message = err["msg"].removeprefix("Value error, ")
    if not err["loc"]:
        return f"{source}: {message}"
    return f"{source}: {key}: {message}{shown}"


def _model_at(root: type[BaseModel], path: tuple[Any, ...]) -> type[BaseModel]:
    """The model class that a validation error's location points into (lists and dicts skipped)."""
    model: Any = root
    for part in path:
        if not hasattr(model, "model_fields") or str(part) not in model.model_fields:
            continue
        annotation = model.model_fields[str(part)].annotation
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            if hasattr(candidate, "model_fields"):
                model = candidate
                break
            for inner in getattr(candidate, "__args__", ()):
                if hasattr(inner, "model_fields"):
                    model = inner
                    break
    return model
