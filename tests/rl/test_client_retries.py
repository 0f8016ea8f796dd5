"""The trainer-side client sends an idempotent call again when its connection breaks before an answer (a kept-alive
connection the server closed, a reset under load), and never a weight-transfer call: those bytes move once. A
loopback server that drops its first connections without answering stands in for the broken network."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest

from rlserve.rl.client import AsyncRLServeClient, RLServeClient


class DroppingServer:
    """Accepts connections on 127.0.0.1; the first `drops` are closed once their request has arrived, the others
    get `{"is_paused": false}`. Counts the connections it saw."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10.0)  # bounded: the thread ends by itself if nobody comes
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        body = json.dumps({"is_paused": False}).encode()
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                conn.settimeout(5.0)
                conn.recv(65536)
                if self.connections <= self.drops:
                    continue  # closed without a word: the client reads end-of-stream
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )

    def close(self) -> None:
        # Closing alone does not wake an accept() blocked in another thread (it waited out its 10 s timeout): a
        # shutdown does, at once.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=10.0)
        assert not self.thread.is_alive()


def test_idempotent_calls_are_retried_after_a_dropped_connection():
    server = DroppingServer(drops=2)
    try:
        with RLServeClient(server.url, timeout=5.0) as client:
            assert client.is_paused() is False
        assert server.connections == 3
    finally:
        server.close()


def test_async_client_retries_too():
    server = DroppingServer(drops=1)

    async def call() -> bool:
        async with AsyncRLServeClient(server.url, timeout=5.0) as client:
            return await client.is_paused()

    try:
        assert asyncio.run(call()) is False
        assert server.connections == 2
    finally:
        server.close()


def test_weight_transfer_calls_are_never_retried():
    server = DroppingServer(drops=1)
    try:
        with RLServeClient(server.url, timeout=5.0) as client, pytest.raises(httpx.TransportError):
            client.start_weight_update()
        assert server.connections == 1
    finally:
        server.close()


def test_retries_are_bounded():
    server = DroppingServer(drops=100)
    try:
        with RLServeClient(server.url, timeout=5.0) as client, pytest.raises(httpx.TransportError):
            client.resume()
        assert server.connections == 4  # the call and its three retries
    finally:
        server.close()
