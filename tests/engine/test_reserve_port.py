"""reserve_port: the port goes to no other socket, yet a listener with SO_REUSEADDR (torch's TCPStore) binds it."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from rlserve.engine.wire.process import reserve_port


def test_a_reserved_port_is_refused_to_other_sockets() -> None:
    with reserve_port() as held:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))


def test_torch_tcp_store_listens_on_a_reserved_port() -> None:
    with reserve_port() as held:
        port = held.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store.set("key", "value")
    assert store.get("key") == b"value" and store.port == port
