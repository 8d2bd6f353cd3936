"""``GET /dashboard``: the quota dashboard, three static files served from the package.

No templating and no build step: the page is static and fetches everything with
the signed-in key. The strict Content-Security-Policy is the point of this module:
the page holds an API key in sessionStorage, so it may load nothing from another
origin, run no inline script, and submit no form anywhere (which also keeps the
key out of any URL).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from steergate.shared.errors import APIError

router = APIRouter(include_in_schema=False)

_FILES: dict[str, str] = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def _static(name: str) -> Response:
    # The files belong to the installed package ``steergate.gateway`` (package-data in
    # pyproject.toml); a top-level ``gateway`` exists only inside the checkout.
    if name not in _FILES:
        raise APIError("not_found", "no such dashboard file")
    body = resources.files("steergate.gateway").joinpath("static", name).read_bytes()
    return Response(body, media_type=_FILES[name], headers=SECURITY_HEADERS)


@router.get("/dashboard")
async def dashboard_page() -> Response:
    return _static("dashboard.html")


@router.get("/dashboard/")
async def dashboard_slash() -> Response:
    """The one path a person types with a slash: sent to the page by path alone (the
    app redirects no other trailing slash, and never to the Host header's origin)."""
    return Response(status_code=308, headers={"location": "/dashboard", **SECURITY_HEADERS})


@router.get("/dashboard/{name}")
async def dashboard_asset(name: str) -> Response:
    return _static(name)
