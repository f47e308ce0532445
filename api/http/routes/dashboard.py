"""The dashboard (``GET /``) and the offline API docs (``GET /docs``: Swagger UI, ``GET /redoc``: ReDoc), static pages from
``api/http/static`` (package data, nothing loaded from a CDN), and the dashboard's plotting library
(``GET /vendor/plotly.min.js``: plotly.js, MIT, read from the installed ``plotly`` package, a dependency).

The pages carry no data and need no key: the dashboard's script asks for the API key (kept in the browser's
sessionStorage) and calls the same /v1 routes as any client, so auth and owner isolation are the API's own.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from api.http.problems import ProblemError
from spec.errors import FoldtuneError

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
STATIC_URL = "/static"
PLOTLY_URL = "/vendor/plotly.min.js"

router = APIRouter(include_in_schema=False)


class DashboardAssetMissing(FoldtuneError):
    """A file the dashboard needs is not installed (the server refuses to start without it)."""


def plotly_js_path() -> Path:
    """plotly.min.js as the installed ``plotly`` package ships it (its package data): the dashboard's plots are
    drawn by it, so that no third-party code lives in this repository and none is fetched from a CDN."""
    try:
        path = Path(str(resources.files("plotly").joinpath("package_data", "plotly.min.js")))
    except ModuleNotFoundError:
        raise DashboardAssetMissing("the dashboard draws its plots with plotly.js from the Python package `plotly`, "
                                    "which is not installed: pip install plotly (a dependency of foldtune)") from None
    if not path.is_file():
        raise DashboardAssetMissing(f"the dashboard draws its plots with plotly.js, but the installed `plotly` "
                                    f"package has no {path}: reinstall it (pip install --force-reinstall plotly)")
    return path


@functools.cache
def _plotly_bodies(path: Path, mtime_ns: int) -> tuple[bytes, bytes, str]:
    """(the file, gzipped, its ETag): about 4.8 MB that a phone would otherwise load as 1.5 MB; read and
    compressed once per file version (``mtime_ns`` keys the cache)."""
    raw = path.read_bytes()
    return raw, gzip.compress(raw, compresslevel=6, mtime=0), f'"{hashlib.sha256(raw).hexdigest()[:32]}"'


@router.get(PLOTLY_URL)
def plotly_js(request: Request) -> Response:
    try:
        path = plotly_js_path()
    except DashboardAssetMissing as exc:  # removed after the server started
        raise ProblemError(503, "dashboard-asset-missing", "Dashboard asset missing", str(exc)) from None
    raw, packed, etag = _plotly_bodies(path, path.stat().st_mtime_ns)
    # revalidated on every page load (cheap: 304 without a body), so an upgraded plotly is picked up at once
    headers = {"ETag": etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding"}
    if etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(packed, media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"})
    return Response(raw, media_type="text/javascript", headers=headers)


@router.get("/")
def dashboard() -> FileResponse:
    return FileResponse(STATIC_DIR / "dashboard" / "index.html", media_type="text/html")


@router.get("/docs")
def swagger_ui() -> HTMLResponse:
    # validatorUrl None: Swagger UI would otherwise fetch a badge from validator.swagger.io.
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title="foldtune API", oauth2_redirect_url=None,
        swagger_js_url=f"{STATIC_URL}/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{STATIC_URL}/swagger-ui/swagger-ui.css",
        swagger_favicon_url=f"{STATIC_URL}/swagger-ui/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None})


@router.get("/redoc")
def redoc() -> HTMLResponse:
    # no Google Fonts link: the page must load nothing from outside the package
    return get_redoc_html(openapi_url="/openapi.json", title="foldtune API",
                          redoc_js_url=f"{STATIC_URL}/redoc/redoc.standalone.js",
                          redoc_favicon_url=f"{STATIC_URL}/swagger-ui/favicon-32x32.png", with_google_fonts=False)


def install_dashboard(app: FastAPI) -> None:
    """Serve the dashboard, its static assets and plotting library, /docs and /redoc (create the app with
    docs_url=None, redoc_url=None). Raises DashboardAssetMissing, one line, when plotly.js is not installed."""
    plotly_js_path()
    app.include_router(router)
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="static")
