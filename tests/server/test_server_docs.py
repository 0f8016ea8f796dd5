"""/docs works offline: a page of the routes that loads nothing from the network, pointing to /openapi.json."""

from __future__ import annotations

import re

import httpx
from server_helpers import Server


def test_docs_page_needs_no_network(server: Server) -> None:
    page = httpx.get(server.url + "/docs", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # Nothing fetched from elsewhere (FastAPI's own page loads Swagger UI from a CDN): no scripts, styles or links
    # that leave the server.
    assert "<script" not in page.text and "<link" not in page.text
    assert not re.search(r"(src|href)=['\"](https?:)?//", page.text)
    assert "href='/openapi.json'" in page.text
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/pause"):
        assert path in schema["paths"] and f"<code>{path}</code>" in page.text
    assert httpx.get(server.url + "/redoc", timeout=10).status_code == 404  # FastAPI's other CDN page is off
