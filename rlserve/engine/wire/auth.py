"""Who may drive an engine core through its socket.

Whoever can talk to a core's socket can pause the engine, overwrite its weights and call its worker extension, so the
socket has two locks. An ipc:// socket lives in a directory of its own that only this user may enter (mkdtemp makes
it 0700 whatever the umask). And every front end presents the core's per-run secret in ZMQ's PLAIN handshake, which
the core's ZAP handler (pyzmq's ThreadAuthenticator) checks before a single message is read: a peer without it never
gets a connection, and the core never sees its messages. That holds for a Ray actor's TCP socket on another node too;
PLAIN carries the secret unencrypted, so there it keeps out whoever cannot read the cluster's network traffic.
"""

from __future__ import annotations

import os
import secrets
import tempfile

import zmq
from zmq.auth.thread import ThreadAuthenticator

USERNAME = "rlserve"
_SOCKET_DIR_PREFIX = "rlserve-core-"
_SOCKET_NAME = "core.sock"


def new_secret() -> str:
    return secrets.token_hex(32)


def private_ipc_address() -> str:
    """A fresh ipc address in a new directory only this user may enter."""
    return f"ipc://{tempfile.mkdtemp(prefix=_SOCKET_DIR_PREFIX)}/{_SOCKET_NAME}"


def remove_ipc_address(address: str) -> None:
    """Remove the socket of an address from `private_ipc_address` and its directory (the core may have been killed
    before it could); nothing for any other address."""
    if not address.startswith("ipc://"):
        return
    path = address.removeprefix("ipc://")
    directory = os.path.dirname(path)
    if os.path.basename(path) != _SOCKET_NAME or not os.path.basename(directory).startswith(_SOCKET_DIR_PREFIX):
        return
    if os.path.exists(path):
        os.unlink(path)
    if os.path.isdir(directory):
        os.rmdir(directory)


def require_secret(context: zmq.Context, socket: zmq.Socket, secret: str) -> ThreadAuthenticator:
    """Make `socket` (bound later) accept only peers that present `secret`; the caller stops the returned handler
    before terminating `context`."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_plain(domain="*", passwords={USERNAME: secret})
    socket.plain_server = True
    return authenticator


def present_secret(socket: zmq.Socket, secret: str) -> None:
    """Set before `socket.connect`: the handshake then carries `secret`."""
    socket.plain_username = USERNAME.encode()
    socket.plain_password = secret.encode()
