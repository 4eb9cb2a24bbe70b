"""Which `Host` headers the server answers (DNS-rebinding protection), and the middleware.

A page a browser loaded from evil.example.com can point that name at 127.0.0.1 and then talk to
a loopback server as "evil.example.com"; refusing unknown Host headers stops it. The check is
Starlette's `TrustedHostMiddleware`, wrapped so that a refusal is an OpenAI-style JSON 400.

Starlette 1.10 keeps the brackets of an IPv6 literal when it parses a Host header
("[::1]:8000" -> host "[::1]") and compares the lowered text, so allowed IPv6 addresses are
written here in brackets and in their compressed form ("::1", "[0::1]" -> "[::1]").
"""
from __future__ import annotations

import ipaddress
from typing import Callable, Iterable

from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specjax.serve.errors import error_response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", "[::]", ""})
_PASSED = "specjax.host_allowed"   # scope key the inner app sets when the check passed


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
    except ValueError:
        return None


def normalize_host(pattern: str) -> str:
    """An allowed-host pattern as Starlette compares it: lower case, IPv6 in brackets. "*"
    allows any host, "*.example.com" any subdomain; no ports."""
    host = pattern.strip().lower()
    if host == "*":
        return host
    address = _address(host)
    if address is not None:
        return f"[{address.compressed}]" if address.version == 6 else address.compressed
    if not host or ":" in host or "/" in host or " " in host:
        raise ValueError(f"not a host name or IP address (no port or scheme): {pattern!r}")
    if "*" in host[1:] or (host.startswith("*") and not host.startswith("*.")):
        raise ValueError(f"a wildcard host must look like '*.example.com', got {pattern!r}")
    return host


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    address = _address(host)
    return address is not None and address.is_loopback


def allowed_hosts_for(bind: str, given: Iterable[str] | None = None) -> tuple[str, ...]:
    """`given` (normalized) if set; else the loopback names, plus the bound address when it
    is not loopback, or any host for a wildcard bind (which answers on every interface)."""
    if given is not None:
        hosts = tuple(dict.fromkeys(normalize_host(h) for h in given if h.strip()))
        if not hosts:
            raise ValueError("--allowed-hosts is empty: name at least one host, or '*'")
        return hosts
    if bind.strip() in WILDCARD_BINDS:
        return ("*",)
    if is_loopback(bind):
        return LOOPBACK_HOSTS
    return LOOPBACK_HOSTS + (normalize_host(bind),)


class HostGuard:
    """`TrustedHostMiddleware` answering refusals with a JSON 400 (`on_reject` counts them)."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str],
                 on_reject: Callable[[int], None] | None = None):
        hosts = [normalize_host(h) for h in allowed_hosts]
        self.app = app
        self.allow_any = "*" in hosts
        self.on_reject = on_reject or (lambda status: None)
        self.check = TrustedHostMiddleware(self._passed, allowed_hosts=hosts,
                                           www_redirect=False)

    async def _passed(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[_PASSED] = True
        await self.app(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allow_any or scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def drop_refusal(message: Message) -> None:
            if scope.get(_PASSED):   # Starlette's own plain-text refusal is replaced below
                await send(message)

        await self.check(scope, receive, drop_refusal)
        if not scope.get(_PASSED):
            self.on_reject(400)
            await error_response(400, "invalid Host header: this server does not answer to "
                                 "that name (see --allowed-hosts)", None, "invalid_host",
                                 {"Connection": "close"})(scope, receive, send)
