"""This host's address and free ports, as vLLM's `vllm.utils.network_utils` finds them (0.24, 0.33): frameworks put
`get_ip()` in a weight-transfer group's `master_address` and `get_open_port()` in its `master_port`, so they follow
vLLM's rules and environment variables (`VLLM_HOST_IP`, `VLLM_PORT`)."""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

HOST_IP_ENV = "VLLM_HOST_IP"
PORT_ENV = "VLLM_PORT"
_PORT_SCAN_ATTEMPTS = 1000
# Any global unicast address works: connecting a UDP socket sends nothing, it only asks the kernel which source
# address its route to there would use (vLLM probes the same two).
_PROBES = ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888"))


def get_ip() -> str:
    """`VLLM_HOST_IP` if set, else the source address of this host's default route (IPv4, then IPv6). With no route
    at all, vLLM's fallback, "0.0.0.0", with a warning: peers on this host reach it, no other host does."""
    configured = os.environ.get(HOST_IP_ENV, "")
    if configured:
        return configured
    for family, probe in _PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 80))
                return s.getsockname()[0]
        except OSError:
            continue
    logger.warning(
        "no route to find this host's address: using 0.0.0.0, which only this host reaches; set %s", HOST_IP_ENV
    )
    return "0.0.0.0"


def get_open_port() -> int:
    """A TCP port free on every interface now: with `VLLM_PORT` set, the first free one from there up (vLLM's rule,
    so that ports stay in an allowed range), else one the kernel picks."""
    start = os.environ.get(PORT_ENV)
    if start is None:
        return _bind_free(0)
    try:
        first = int(start)
    except ValueError:
        raise ValueError(f"{PORT_ENV}: expected a port number, got {start!r}") from None
    if not 0 < first < 65536:
        raise ValueError(f"{PORT_ENV}: {first} is not a TCP port (1-65535)")
    for port in range(first, min(first + _PORT_SCAN_ATTEMPTS, 65536)):
        try:
            return _bind_free(port)
        except OSError:
            continue
    raise OSError(f"no free port in the {_PORT_SCAN_ATTEMPTS} ports from {PORT_ENV}={first}")


def _bind_free(port: int) -> int:
    """Bind `port` (0: any) on every interface and release it; IPv6 where the host has no IPv4 (vLLM's fallback)."""
    error: OSError | None = None
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind(("", port))
                return s.getsockname()[1]
        except OSError as e:
            error = e
    assert error is not None
    raise error
