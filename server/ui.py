"""The playground at /ui: three static files (server/ui/) that talk to the public API only.

    GET /ui, /ui/     -> ui/index.html
    GET /ui/ui.js     -> ui/ui.js
    GET /ui/ui.css    -> ui/ui.css

Installed by `create_app` when `settings.ui_enabled` (on by default for a loopback host);
otherwise /ui is an unknown path (404 in the OpenAI envelope). The routes take no API key
(the page asks for one and sends it itself), are left out of the OpenAPI document, and
answer with a strict Content-Security-Policy: the page loads nothing from another origin
and runs no inline script or style. The files are read once, when the router is built.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

UI_DIR = Path(__file__).resolve().parent / "ui"
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# file name -> media type; every file the page needs, nothing else is served.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "ui.js": "text/javascript; charset=utf-8",
    "ui.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def ui_router() -> APIRouter:
    """A router serving the playground's files (read now, from the installed package)."""
    bodies = {name: (UI_DIR / name).read_bytes() for name in ASSETS}
    router = APIRouter(include_in_schema=False)

    def asset(name: str):
        async def serve() -> Response:
            return Response(bodies[name], media_type=ASSETS[name], headers=_HEADERS)

        return serve

    router.add_api_route("/ui", asset("index.html"), methods=["GET"])
    router.add_api_route("/ui/", asset("index.html"), methods=["GET"])
    for name in ("ui.js", "ui.css"):
        router.add_api_route(f"/ui/{name}", asset(name), methods=["GET"])
    return router
