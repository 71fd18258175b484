"""/docs (Swagger UI) and /redoc with their scripts served by this server, not by a CDN, so that
the docs of a server without internet access work.

The files come from the ``fastapi-offline`` package (MIT; it ships Swagger UI 5, Apache-2.0, and
ReDoc, MIT: about 2.8 MB installed). Swagger UI 5 is needed: FastAPI writes OpenAPI 3.1, which
Swagger UI 4 (the ``swagger-ui-bundle`` package) cannot render.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"


def install_docs(app: FastAPI) -> None:
    """Add /docs, /redoc and their assets to ``app`` (built with ``docs_url=None, redoc_url=None``)."""
    app.mount(ASSETS_URL, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")
    title, openapi_url = app.title, app.openapi_url or "/openapi.json"
    oauth2_redirect = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{title} - Swagger UI",
                                   oauth2_redirect_url=oauth2_redirect,
                                   swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS_URL}/favicon.png")

    @app.get(oauth2_redirect, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url, title=f"{title} - ReDoc",
                              redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS_URL}/favicon.png", with_google_fonts=False)
