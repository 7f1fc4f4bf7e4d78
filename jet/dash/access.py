"""Who may talk to `jet dash`: an ASGI middleware in front of every route.

Rules, in order:
- bound to loopback, only requests whose Host header names a loopback address
  are answered (421 otherwise), so a web page elsewhere cannot reach the
  dashboard through a DNS name that resolves to 127.0.0.1 (DNS rebinding);
- with a token (always, when bound elsewhere), every request carries it: as
  `Authorization: Bearer <token>`, as the cookie set by a first page load with
  `?token=<token>` (which then redirects to the same page without it), or as
  `?token=` on any API call; otherwise 401;
- a POST must come from the dashboard's own origin (an Origin header, when
  sent, names the Host) and carry JSON; so a form on another site cannot
  requeue or drop dead letters.
"""

from __future__ import annotations

import hmac
import ipaddress
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode, urlsplit

COOKIE = "jet_dash_token"


def is_loopback(host: str) -> bool:
    """Whether a bind address or a Host header's name is a loopback one."""
    host = host.strip("[]")
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """`127.0.0.1:8265` -> `127.0.0.1`, `[::1]:8265` -> `::1`."""
    if host.startswith("["):
        return host[1:host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Access:
    def __init__(self, app, *, token: str | None, loopback: bool):
        self.app, self.token, self.loopback = app, token, loopback

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.loopback and not is_loopback(_host_name(host)):
            return await _plain(send, 421, f"this dashboard answers loopback names only, not {host!r}")
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if self.token and not self._allowed(headers, query):
            return await _plain(send, 401, "a token is required: open the URL `jet dash` printed "
                                "(…?token=…) or send Authorization: Bearer <token>")
        if self.token and "token" in query and scope["method"] == "GET" and not scope["path"].startswith(("/api", "/metrics")):
            rest = urlencode([(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode()) if k != "token"])
            return await _redirect(send, scope["path"] + (f"?{rest}" if rest else ""), self.token)
        if scope["method"] not in ("GET", "HEAD"):
            origin = headers.get("origin")
            if origin and urlsplit(origin).netloc != host:
                return await _plain(send, 403, f"cross-origin request from {origin} refused")
        return await self.app(scope, receive, send)

    def _allowed(self, headers: dict, query: dict) -> bool:
        auth = headers.get("authorization", "")
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001 - a malformed cookie header is just no cookie
            pass
        given = [auth[7:] if auth.lower().startswith("bearer ") else "", query.get("token", ""),
                 cookie[COOKIE].value if COOKIE in cookie else ""]
        return any(g and hmac.compare_digest(g.encode(), self.token.encode()) for g in given)


async def _plain(send, status: int, text: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
    await send({"type": "http.response.body", "body": text.encode()})


async def _redirect(send, location: str, token: str) -> None:
    cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location.encode()), (b"set-cookie", cookie.encode())]})
    await send({"type": "http.response.body", "body": b""})
