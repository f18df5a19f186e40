"""The dashboard's HTTP server: the page, its script and style, and ``/api/view``.

A stdlib :class:`http.server.ThreadingHTTPServer` in a thread of its own: the page is
one HTML file, one script, one stylesheet and an icon shipped in this package (nothing from a
CDN, so it works offline), and ``/api/view`` answers the latest snapshot the dashboard
process set (:meth:`DashboardServer.publish`). Only GET and HEAD: other methods are 405,
unknown paths 404.

Peer-provided strings reach the page only as JSON, and the script puts them in the DOM
as text (``textContent``), never as markup. Every response also carries a strict
Content-Security-Policy (scripts, styles and requests from this origin only, no inline
script), so even a bug in the script could not run what a hostile peer sent.

On loopback the server answers only requests addressed to a loopback name (the
``Host`` header): a web page elsewhere that points its own host name at 127.0.0.1 (DNS
rebinding) is refused, so it cannot read the swarm's view through the visitor's browser.
"""

from __future__ import annotations

import ipaddress
import json
import math
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import urlsplit

#: Loopback unless told otherwise: the page names peers, addresses and runs.
DEFAULT_DASHBOARD_HOST = "127.0.0.1"

#: Nothing but this origin's own script, stylesheet and ``/api/view``; no inline script
#: or style, no plugins, no framing, no forms.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: Seconds a connection may sit idle (before its request or between its bytes): the page
#: polls every few seconds and sends its request at once, so only a stalled or hostile
#: client waits this long, and each costs one thread until then.
REQUEST_TIMEOUT_SECONDS = 30.0
#: Host names a loopback dashboard answers to (with any port: ``ssh -L`` may forward
#: another local port to it).
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
_ALLOWED_METHODS = "GET, HEAD"


def _load_static() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("swarm.dashboard") / "static"
    return {path: ((folder / name).read_bytes(), kind) for path, (name, kind) in _STATIC.items()}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name, IPv6 with or without brackets) names this
    machine only."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def finite(value: object) -> object:
    """``value`` (JSON types) with every NaN or infinity replaced by None: figures are
    sums and medians of peers' claims, and two finite claims near the float limit sum to
    infinity, which JSON cannot carry."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class DashboardServer:
    """Serves the page on ``host:port`` (port 0: a free one) from :meth:`start` to
    :meth:`close`; :meth:`publish` replaces what ``/api/view`` answers (any thread)."""

    def __init__(self) -> None:
        self._files = _load_static()
        self._lock = threading.Lock()
        self._snapshot = b'{"view": null, "history": null}'
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._loopback_only = True

    def publish(self, snapshot: dict[str, object]) -> None:
        """Serve ``snapshot`` (JSON types; non-finite numbers become null) from now on."""
        data = json.dumps(finite(snapshot), allow_nan=False, separators=(",", ":")).encode()
        with self._lock:
            self._snapshot = data

    def _current(self) -> bytes:
        with self._lock:
            return self._snapshot

    def start(self, host: str, port: int) -> int:
        """Listen and serve in a thread; the bound port. Raises OSError if it cannot bind."""
        self._loopback_only = is_loopback(host)
        kind = _IPv6Server if ":" in host else ThreadingHTTPServer
        self._httpd = kind((host.strip("[]"), port), _handler_for(self))
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


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler_for(server: DashboardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "swarm-dashboard"
        sys_version = ""
        timeout = REQUEST_TIMEOUT_SECONDS

        def do_GET(self) -> None:
            self._answer(with_body=True)

        def do_HEAD(self) -> None:
            self._answer(with_body=False)

        def _refuse_method(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"only GET and HEAD\n", "text/plain")

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

        def _answer(self, *, with_body: bool) -> None:
            host = self._host_name()
            if server._loopback_only and host and not is_loopback(host):
                body = b"this dashboard answers requests for 127.0.0.1 or localhost only\n"
                self._send(HTTPStatus.FORBIDDEN, body, "text/plain", with_body)
                return
            path = self.path.split("?", 1)[0]
            if path == "/api/view":
                self._send(HTTPStatus.OK, server._current(), "application/json", with_body)
            elif path in server._files:
                body, kind = server._files[path]
                self._send(HTTPStatus.OK, body, kind, with_body)
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", with_body)

        def _host_name(self) -> str:
            """The name the request was sent to, without its port ("" without a Host
            header: not a browser, which always sends one)."""
            host = self.headers.get("Host", "")
            try:
                return urlsplit(f"//{host}").hostname or ""
            except ValueError:  # a bracket or port that does not parse
                return "?"

        def send_error(
            self, code: int, message: str | None = None, explain: str | None = None
        ) -> None:
            # The stdlib's error page is HTML without our headers; a malformed request
            # (bad request line, too long, unknown method) gets a plain one with them.
            status = HTTPStatus(code)
            body = f"{status.value} {message or status.phrase}\n".encode(errors="replace")
            self.close_connection = True
            self._send(status, body, "text/plain", with_body=self.command != "HEAD")

        def _send(self, status: HTTPStatus, body: bytes, kind: str, with_body: bool = True) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Cache-Control", "no-store")
            if status == HTTPStatus.METHOD_NOT_ALLOWED:
                self.send_header("Allow", _ALLOWED_METHODS)
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a page polling every 2 s would fill the terminal

    return Handler
