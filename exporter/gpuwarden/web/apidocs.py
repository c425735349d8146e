"""/docs without a CDN: an HTML page of the API rendered from the app's own OpenAPI schema, with no script and no
request outside the server. FastAPI's Swagger UI loads its JavaScript and CSS from a public CDN, which leaves the
page blank in the air-gapped clusters many GPU fleets run in; /openapi.json stays for tools that render it.
"""

from __future__ import annotations

import html
from typing import Any

METHODS = ("get", "head", "post", "put", "patch", "delete")


def render_docs(schema: dict[str, Any]) -> str:
    info = schema.get("info", {})
    rows = []
    for path, operations in sorted(schema.get("paths", {}).items()):
        for method in METHODS:
            operation = operations.get(method)
            if operation is None:
                continue
            params = ", ".join(
                f"{p['name']} ({p.get('in', '')}{', required' if p.get('required') else ''})"
                for p in operation.get("parameters", [])
            )
            codes = ", ".join(sorted(operation.get("responses", {})))
            rows.append(
                f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                f"<td>{html.escape(operation.get('summary', ''))}</td><td>{html.escape(params) or '—'}</td>"
                f"<td>{html.escape(codes)}</td></tr>"
            )
    title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}".strip())
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>"
        f"{title} — API</title><style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:75em}}"
        "table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.35em .6em;"
        "text-align:left;vertical-align:top}code{font-size:.95em}</style></head><body>"
        f"<h1>{title}</h1><p>{html.escape(info.get('description', ''))}</p>"
        "<p>The full schema: <a href='/openapi.json'>/openapi.json</a> (load it into any OpenAPI viewer).</p>"
        "<table><thead><tr><th>method</th><th>path</th><th>what</th><th>parameters</th><th>answers</th></tr>"
        f"</thead><tbody>{''.join(rows)}</tbody></table></body></html>"
    )


def add_offline_docs(app: Any) -> None:
    """Serve /docs from the app's schema (create the app with docs_url=None and redoc_url=None)."""
    from fastapi.responses import HTMLResponse

    page: list[str] = []

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> HTMLResponse:
        if not page:
            page.append(render_docs(app.openapi()))
        return HTMLResponse(page[0])
