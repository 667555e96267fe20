"""/dashboard on the router: a page, its two static files (shipped in the package, no CDN) and one JSON endpoint.

Auth: the same API keys as the OpenAI API. The page and its assets hold no data and are served to anyone; the
page asks for a key, keeps it in the tab's sessionStorage (gone when the tab closes) and sends it as
`Authorization: Bearer` to /dashboard/api/state, which answers 401 without one (when auth.api_key_required).
A strict Content-Security-Policy keeps the page to its own origin: it works offline and loads nothing else.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmdeploy.openai_api.errors import OpenAIError
from llmdeploy.router.dashboard_data import dashboard_state

ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
AUTH_MARK = "{{AUTH}}"


@cache
def asset(name: str) -> bytes:
    return (files("llmdeploy.router") / "static" / name).read_bytes()


def _headers(cache: bool) -> dict[str, str]:
    return {
        "content-security-policy": CSP,
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
        "cache-control": "max-age=300" if cache else "no-store",
    }


def install_dashboard(app, router) -> None:
    async def page(request: Request) -> Response:
        auth = "required" if router.settings.keys.required else "none"
        html = asset("index.html").decode().replace(AUTH_MARK, auth)
        return Response(html, media_type="text/html; charset=utf-8", headers=_headers(False))

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return OpenAIError(404, f"No dashboard asset named {name[:64]!r}.", code="not_found").response()
        return Response(asset(name), media_type=ASSETS[name], headers=_headers(True))

    async def state(request: Request) -> Response:
        try:
            router.settings.keys.authenticate(request.headers)
        except OpenAIError as e:
            return e.response()
        doc = dashboard_state(router, await router.observer.feed())
        return JSONResponse(doc, headers=_headers(False))

    app.router.add_route("/dashboard", page, methods=["GET"])
    app.router.add_route("/dashboard/", page, methods=["GET"])
    app.router.add_route("/dashboard/static/{name}", static, methods=["GET"])
    app.router.add_route("/dashboard/api/state", state, methods=["GET"])
