"""The wires of data-parallel lockstep between engine-core processes: the wave's all-gather and the wave notices.

No coordinator process: the wave number is agreed by the all-gather itself (every rank ends a wave at the same
collective), and a wave notice is idempotent (a rank joins the wave it is told of if it is its current one), so
any rank may start a wave and tell the others directly. That leaves nothing for a coordinator to own, and nothing
more to start, place (Ray) or supervise: a rank process needs only the rendezvous address in its config, however
it was started.

- The all-gather: a gloo group of the ranks on the host CPU (vLLM's choice for this flag sync, on CUDA too), built on
  a TCPStore at `data_parallel_master_ip:data_parallel_master_port` that rank 0 serves. A group of its own, not
  torch.distributed's default one, which other parts of a rank (tensor parallel workers) may own.
  The same store (`rendezvous_store`, made before the model, which needs it under expert parallel) also builds the
  expert-parallel group (rlserve.model.expert_parallel).
- The notices: each rank binds a ZMQ PULL socket on `data_parallel_master_ip`, publishes its address in the store
  and connects a PUSH socket to every peer's. A forged notice would desynchronise the ranks (one told of a far-off
  wave starts waves its peers never join, and dies in the all-gather), so the PULL socket is locked as the core's own
  socket is (wire/auth.py): a sender must present the group's secret in ZMQ's PLAIN handshake, or it never gets a
  connection. The launcher that starts every rank hands each the one secret (CoreStartup.lockstep_secret); it never
  goes through the store, which any host that reaches its port may read (a TCPStore has no authentication).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import zmq

from rlserve.config import EngineConfig
from rlserve.engine.core.dp_wave import SyncFlags
from rlserve.engine.wire.auth import present_secret, require_secret
from rlserve.engine.wire.process import COLLECTIVE_TIMEOUT

if TYPE_CHECKING:
    import torch.distributed

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)  # every rank's model loads before it joins
_NOTICE_KEY = "rlserve/dp/notices/{}"


class PeerLost(RuntimeError):
    """A peer rank left the group (stopped, or died): this rank cannot step in lockstep any more."""


def rendezvous_store(config: EngineConfig) -> torch.distributed.TCPStore:
    """The ranks' store at `data_parallel_master_ip:data_parallel_master_port`, served by rank 0; it waits for
    every rank (they start together)."""
    import torch.distributed as dist  # here: the front end imports the core's main loop (its process target)

    rank, size = config.data_parallel_rank, config.data_parallel_size
    return dist.TCPStore(
        config.data_parallel_master_ip,
        config.data_parallel_master_port,
        size,
        is_master=rank == 0,
        timeout=RENDEZVOUS_TIMEOUT,
    )


class LockstepLink:
    """One rank's end: `all_gather(flags)` blocks until every rank gave its flags; `announce(wave)` tells the peers
    a wave started; `socket` becomes readable when a peer's notice arrived (`receive` reads it)."""

    def __init__(self, config: EngineConfig, store: torch.distributed.TCPStore, secret: str) -> None:
        """`secret`: the group's, which every rank was started with (the launcher's)."""
        import torch
        import torch.distributed as dist

        rank, size = config.data_parallel_rank, config.data_parallel_size
        self.rank, self.size = rank, size
        host = config.data_parallel_master_ip
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("rlserve/dp/gloo", store), rank, size, COLLECTIVE_TIMEOUT)
        # A context of its own: a context has one handler of handshakes (ZAP), and the core's socket has another
        # secret, checked by the handler of the core's context.
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._authenticator = require_secret(self._context, self.socket, secret)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        store.set(_NOTICE_KEY.format(rank), f"tcp://{host}:{port}")
        self._peers = []
        for peer in range(size):
            if peer != rank:
                push = self._context.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.setsockopt(zmq.SNDHWM, 0)  # a notice is never dropped: a peer that missed one would not join
                present_secret(push, secret)
                push.connect(store.get(_NOTICE_KEY.format(peer)).decode())
                self._peers.append(push)
        self._store = store  # rank 0 serves it for as long as the group lives
        self._sent = torch.zeros(4, dtype=torch.int64)
        self._received = [torch.zeros(4, dtype=torch.int64) for _ in range(size)]

    def all_gather(self, flags: SyncFlags) -> list[SyncFlags]:
        for i, flag in enumerate(flags):
            self._sent[i] = flag
        try:
            self.group.allgather([self._received], [self._sent]).wait()
        except RuntimeError as e:  # gloo: "Connection closed by peer", a timeout
            raise PeerLost(str(e).splitlines()[0].split(" This is typically")[0]) from None
        return [tuple(t.tolist()) for t in self._received]

    def announce(self, wave: int) -> None:
        for push in self._peers:
            push.send(wave.to_bytes(8, "little"), zmq.NOBLOCK)

    def receive(self) -> int:
        return int.from_bytes(self.socket.recv(), "little")

    def close(self) -> None:
        for push in self._peers:
            push.close(linger=0)
        self.socket.close(linger=0)
        self._authenticator.stop()
        self._context.term()
