"""The dashboard's HTTP server: the page, its script and style, and ``/api/view``.

A stdlib :class:`http.server.ThreadingHTTPServer` in a thread of its own: the page is
one HTML file, one script and one stylesheet shipped in this package (nothing from a
CDN, so it works offline), and ``/api/view`` answers the latest snapshot the dashboard
process set (:meth:`DashboardServer.publish`). Only GET and HEAD; anything else is 405,
unknown paths 404.

Peer-provided strings reach the page only as JSON, and the script puts them in the DOM
as text (``textContent``), never as markup. Every response also carries a strict
Content-Security-Policy (scripts, styles and requests from this origin only, no inline
script), so even a bug in the script could not run what a hostile peer sent.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

#: Loopback unless told otherwise: the page names peers, addresses and runs.
DEFAULT_DASHBOARD_HOST = "127.0.0.1"

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}


def _load_static() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("swarm.dashboard") / "static"
    return {path: ((folder / name).read_bytes(), kind) for path, (name, kind) in _STATIC.items()}


class DashboardServer:
    """Serves the page on ``host:port`` (port 0: a free one) from :meth:`start` to
    :meth:`close`; :meth:`publish` replaces what ``/api/view`` answers (any thread)."""

    def __init__(self) -> None:
        self._files = _load_static()
        self._lock = threading.Lock()
        self._snapshot = b'{"view": null, "history": null}'
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def publish(self, snapshot: dict[str, object]) -> None:
        data = json.dumps(snapshot, allow_nan=False).encode()
        with self._lock:
            self._snapshot = data

    def _current(self) -> bytes:
        with self._lock:
            return self._snapshot

    def start(self, host: str, port: int) -> int:
        """Listen and serve in a thread; the bound port. Raises OSError if it cannot bind."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "swarm-dashboard"
            sys_version = ""

            def do_GET(self) -> None:
                self._answer(with_body=True)

            def do_HEAD(self) -> None:
                self._answer(with_body=False)

            def _answer(self, *, with_body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/api/view":
                    self._send(HTTPStatus.OK, server._current(), "application/json", with_body)
                elif path in server._files:
                    body, kind = server._files[path]
                    self._send(HTTPStatus.OK, body, kind, with_body)
                else:
                    self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", with_body)

            def _send(self, status: HTTPStatus, body: bytes, kind: str, with_body: bool) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # a page polling every 2 s would fill the terminal

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="swarm-dashboard", daemon=True
        )
        self._thread.start()
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        """Stop serving and join the thread. Idempotent."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
