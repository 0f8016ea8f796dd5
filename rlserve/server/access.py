"""Who may call which route, decided from the request's head alone (pure ASGI middleware, as vLLM's authentication
is): a wrong or missing key is a 401 before a byte of the body is read, so a large keyless body costs the event loop
nothing.

Three kinds of routes: public ones (`/health`, `/version`, `/metrics`, `/load`, the docs) need nothing; the RL
control routes need a key of `--rl-api-key` (by default the `--api-key` keys); every other route (`/v1`,
`/inference`, tokenization, `/server_info`) needs a key of `--api-key` when one is set. Routes served without a key
(`--rl-api-auth none`, vLLM's dev mode, or no `--api-key`) refuse a cross-origin browser request (an `Origin` that is
not the request's own), and keyless RL routes also a `Host` that is not an address of this machine: a web page, even
through DNS rebinding, cannot pause the engine or overwrite its weights.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from rlserve.engine.wire.call_policy import confined_weight_dir
from rlserve.server.errors import APIError, error_response

# Routes that reveal nothing a caller could misuse, served to anyone (orchestrators probe them without keys).
PUBLIC_PATHS = frozenset({"/health", "/health/", "/version", "/metrics", "/load", "/docs", "/openapi.json"})
LOCAL_HOST_NAMES = frozenset({"localhost", "localhost.localdomain"})


@dataclass(frozen=True)
class AccessPolicy:
    """`api_keys`: accepted on `api_paths` (none: those are keyless); `rl_keys`: accepted on `rl_paths` (none:
    keyless, vLLM's dev mode); any other path is public or no route's (a 404). `bound_host`: the address the server
    listens on, which a keyless RL route's `Host` may name besides this machine's addresses and names."""

    api_keys: tuple[str, ...]
    rl_keys: tuple[str, ...]
    api_paths: frozenset[str]
    rl_paths: frozenset[str]
    bound_host: str = "127.0.0.1"


def key_matches(authorization: str, keys: Sequence[bytes]) -> bool:
    """Whether `Authorization: Bearer <token>` carries one of `keys`. Every key is compared, in constant time each:
    how long the check takes says nothing about which key is close."""
    scheme, _, token = authorization.partition(" ")
    sent = token.strip().encode()
    matches = [secrets.compare_digest(sent, key) for key in keys]
    return scheme.lower() == "bearer" and any(matches)


def _host_name(netloc: str) -> str:
    """The host of a `Host` header or an origin's netloc, without its port or IPv6 brackets, lower-cased."""
    try:
        host = urlsplit(f"//{netloc}").hostname
    except ValueError:  # a malformed IPv6 literal
        return ""
    return (host or "").lower()


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def machine_host_names(bound_host: str) -> frozenset[str]:
    """The names a same-host or same-network client may put in `Host`: the bound address, localhost, and this
    machine's own names. Any IP literal is accepted too (see `host_refusal`)."""
    names = {bound_host.lower(), socket.gethostname().lower(), socket.getfqdn().lower(), *LOCAL_HOST_NAMES}
    return frozenset(name for name in names if name)


def host_refusal(headers: dict[bytes, bytes], known_names: Collection[str]) -> APIError | None:
    """A 403 naming `Host` if it names a host other than an IP address or one of `known_names`: DNS rebinding
    points an attacker's name at 127.0.0.1, and the browser then sends that name (an IP literal cannot be
    rebound)."""
    host = _host_name(headers.get(b"host", b"").decode("latin-1"))
    if _is_ip_literal(host) or host in known_names:
        return None
    return APIError(403, f"Host: {host!r} is not this server's address; keyless routes answer only to it", "Host")


def origin_refusal(headers: dict[bytes, bytes]) -> APIError | None:
    """A 403 naming `Origin` if a browser sent the request from another origin (a page of any other site or port,
    or an opaque `null` origin); clients other than browsers send no `Origin`."""
    origin = headers.get(b"origin")
    if origin is None:
        return None
    text = origin.decode("latin-1")
    try:
        netloc = urlsplit(text).netloc
    except ValueError:
        netloc = ""
    if netloc and netloc.lower() == headers.get(b"host", b"").decode("latin-1").lower():
        return None
    return APIError(403, f"Origin: {text!r} is another origin; keyless routes refuse cross-origin requests", "Origin")


class AccessGuard:
    """ASGI middleware that applies an `AccessPolicy` from the request's head, before the body is read."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy
        self.api_keys = [key.encode() for key in policy.api_keys]
        self.rl_keys = [key.encode() for key in policy.rl_keys]
        self.known_hosts = machine_host_names(policy.bound_host)

    def refusal(self, scope: Scope) -> APIError | None:
        path = scope["path"]
        is_rl = path in self.policy.rl_paths
        if not (is_rl or path in self.policy.api_paths) or scope.get("method") == "OPTIONS":
            return None
        headers = dict(scope["headers"])
        keys = self.rl_keys if is_rl else self.api_keys
        if keys:
            if key_matches(headers.get(b"authorization", b"").decode("latin-1"), keys):
                return None
            which = "--rl-api-key" if is_rl else "--api-key"
            return APIError(401, f"missing or wrong API key: send 'Authorization: Bearer <key>' ({which})")
        return origin_refusal(headers) or (host_refusal(headers, self.known_hosts) if is_rl else None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def confined_dir(path: str, allowed: Collection[str], param: str) -> str:
    """`confined_weight_dir` (the check the core applies too) answered as HTTP: 403 outside the allowed directories
    or for a missing one (one message for both), 400 for a path no file system holds."""
    try:
        return confined_weight_dir(path, allowed, param)
    except PermissionError as e:
        raise APIError(403, str(e), param) from e
    except ValueError as e:
        raise APIError(400, str(e), param) from e


ANY_HOST = "*"


def _addresses(host: str) -> frozenset[str]:
    """The IP addresses `host` resolves to now (none if it does not resolve)."""
    try:
        return frozenset(info[4][0] for info in socket.getaddrinfo(host, None))
    except (OSError, UnicodeError):
        return frozenset()


@dataclass(frozen=True)
class RendezvousHosts:
    """Where /init_weight_transfer_engine may make the engine connect (`init_info.master_address`): a loopback
    address, or a host that `names` lists or that resolves only to `addresses`; anywhere with `any_host`. The
    caller must not turn the server into a port scanner of the cluster."""

    names: frozenset[str]
    addresses: frozenset[str]
    any_host: bool = False

    @classmethod
    def allow(cls, hosts: Sequence[str] | None, bound_host: str) -> RendezvousHosts:
        """`hosts`: --allowed-rendezvous-hosts (`*`: any); None: this machine (its names, what they resolve to,
        the bound address), where a same-host trainer serves its group."""
        if hosts is not None and ANY_HOST in hosts:
            return cls(frozenset(), frozenset(), any_host=True)
        names = set(machine_host_names(bound_host)) if hosts is None else {host.lower() for host in hosts}
        addresses = frozenset(address for name in names for address in _addresses(name))
        return cls(frozenset(names), addresses)

    async def check(self, init_info: dict[str, Any]) -> None:
        """403 naming init_info.master_address if it is not a host the operator allowed."""
        await self.check_host(init_info.get("master_address"), "init_info.master_address")

    async def check_host(self, host: object, field: str) -> None:
        """403 naming `field` if `host` is not a host the operator allowed."""
        if self.any_host or not isinstance(host, str) or host.lower() in self.names:
            return  # not a string: the backend's own check names the field
        resolved = await asyncio.to_thread(_addresses, host) if not _is_ip_literal(host) else frozenset({host})
        if resolved and all(ipaddress.ip_address(a).is_loopback or a in self.addresses for a in resolved):
            return
        raise APIError(
            403,
            f"{field}: {host!r} is not a rendezvous host this server may connect to (this machine by default; the "
            "operator allows others with --allowed-rendezvous-hosts HOST..., or '*' for any)",
            field,
        )
