"""The dashboard (``GET /``) and the offline API docs (``GET /docs``: Swagger UI, ``GET /redoc``: ReDoc), static pages from
``api/http/static`` (package data, nothing loaded from a CDN).

The pages carry no data and need no key: the dashboard's script asks for the API key (kept in the browser's
sessionStorage) and calls the same /v1 routes as any client, so auth and owner isolation are the API's own.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
STATIC_URL = "/static"

router = APIRouter(include_in_schema=False)


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
    """Serve the dashboard, its static assets, /docs and /redoc (create the app with docs_url=None, redoc_url=None)."""
    app.include_router(router)
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="static")
