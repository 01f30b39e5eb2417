"""One rank's view of a process group: the handful of collectives minillm uses, each one counted.

Process groups are made directly (`ProcessGroupGloo(store, rank, size)`), never through
`torch.distributed.init_process_group`: that global default group exists once per process, while minillm may hold
several engines in one process (tests, notebooks) and ranks may be threads of one process (the lab). Every
collective goes through a Communicator, so the bench can report exactly what was sent: payload bytes, the number of
messages and the seconds spent waiting in them.

gloo runs on CPU (over TCP, loopback on one machine); NCCL on CUDA. The same calls serve both.
"""
from __future__ import annotations

import datetime
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minillm import config

DEFAULT_TIMEOUT = config.dist_timeout()


@dataclass
class CommStats:
    """What one rank sent: payload bytes and messages per kind of collective, and seconds spent inside them."""
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    messages: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes[kind] += nbytes
        self.messages[kind] += 1
        self.seconds[kind] += seconds

    def reset(self) -> None:
        self.bytes.clear()
        self.messages.clear()
        self.seconds.clear()

    def total(self, what: str = "bytes", exclude: tuple[str, ...] = ()) -> float:
        return sum(v for k, v in getattr(self, what).items() if k not in exclude)

    def snapshot(self) -> dict:
        return {k: {"bytes": self.bytes[k], "messages": self.messages[k], "seconds": self.seconds[k]}
                for k in sorted(self.messages)}


class Communicator:
    """Collectives over one process group. A world of one needs no group: every operation is then the identity,
    so the single-process model runs the same code with no cost."""

    def __init__(self, pg=None, rank: int = 0, world_size: int = 1, cpu_pg=None) -> None:
        """`cpu_pg`: a gloo group beside an NCCL `pg`, for the collectives on CPU tensors (the step broadcast)."""
        if world_size > 1 and pg is None:
            raise ValueError("a Communicator for more than one rank needs a process group")
        self.pg, self.rank, self.world_size, self.cpu_pg = pg, rank, world_size, cpu_pg
        self.stats = CommStats()

    def _group(self, t: torch.Tensor):
        """The group that moves `t`: NCCL moves GPU tensors only, so CPU ones go over the gloo group beside it."""
        return self.cpu_pg if self.cpu_pg is not None and t.device.type == "cpu" else self.pg

    def _timed(self, kind: str, nbytes: int, work_fn):
        t0 = time.perf_counter()
        work_fn().wait()
        self.stats.add(kind, nbytes, time.perf_counter() - t0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (every rank ends with the sum)."""
        if self.world_size > 1:
            self._timed("all_reduce", t.nbytes, lambda: self._group(t).allreduce([t]))
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (same shape everywhere), concatenated along `dim` in rank order, on every rank."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._timed("all_gather", t.nbytes, lambda: self._group(t).allgather([parts], [t]))
        return torch.cat(parts, dim=dim)

    def gather(self, t: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
        """Every rank's `t` concatenated along `dim` on rank `dst` (None elsewhere): the LM head's logits go only
        where the sampler is."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = dst
        if self.rank == dst:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self._timed("gather", t.nbytes, lambda: self._group(t).gather([parts], [t], opts))
            return torch.cat(parts, dim=dim)
        self._timed("gather", t.nbytes, lambda: self._group(t).gather([], [t], opts))
        return None

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self._timed("broadcast", t.nbytes if self.rank == src else 0, lambda: self._group(t).broadcast([t], opts))
        return t

    def send(self, t: torch.Tensor, dst: int, tag: int = 0):
        """Start sending `t` to rank `dst`; returns the pending work (call .wait() before reusing `t`)."""
        t0 = time.perf_counter()
        work = self._group(t).send([t], dst, tag)
        self.stats.add("send", t.nbytes, time.perf_counter() - t0)
        return work

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self._timed("recv", 0, lambda: self._group(t).recv([t], src, tag))
        return t

    def release(self) -> None:
        """Drop the process group: its sockets close, so a peer waiting in a collective with this rank fails at
        once instead of waiting for a timeout (what a crashed process does by dying)."""
        self.pg = self.cpu_pg = None
        import gc
        gc.collect()



def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_process_group(store, rank: int, world_size: int, backend: str = "gloo",
                       timeout: datetime.timedelta = DEFAULT_TIMEOUT):
    """A process group for `rank` of `world_size` that meets the others through `store`."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"unknown distributed backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")


def connect(host: str, port: int, rank: int, world_size: int, backend: str = "gloo", prefix: str = "minillm",
            timeout: datetime.timedelta = DEFAULT_TIMEOUT, store=None) -> Communicator:
    """Join the group whose rank 0 serves a TCPStore at host:port (rank 0 passes its own `store`)."""
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
    pg = make_process_group(dist.PrefixStore(prefix, store), rank, world_size, backend, timeout)
    # NCCL moves GPU tensors only: the step's inputs (built on the host) are broadcast over gloo beside it
    cpu_pg = (make_process_group(dist.PrefixStore(prefix + "/cpu", store), rank, world_size, "gloo", timeout)
              if backend == "nccl" else None)
    return Communicator(pg, rank, world_size, cpu_pg)


def on_threads(world_size: int, fn) -> list:
    """fn(rank) on `world_size` threads at once; the results in rank order. The first exception is re-raised here
    once every thread has finished (a rank that fails should release its Communicator so the others do not wait
    for it in a collective)."""
    import threading
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def run_on_ranks(world_size: int, fn) -> list:
    """fn(comm) on `world_size` thread ranks over fresh Communicators (real gloo over loopback); the results in rank
    order. For notebooks and tests: the simplest way to run the same code on every rank."""
    comms = thread_communicators(world_size)

    def rank_fn(rank: int):
        try:
            return fn(comms[rank])
        except BaseException:
            comms[rank].release()     # the other ranks see the group break instead of waiting
            raise
    return on_threads(world_size, rank_fn)


def thread_communicators(world_size: int, backend: str = "gloo",
                         timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> list[Communicator]:
    """`world_size` connected Communicators in this process, one per rank, for ranks that run as threads (the
    lab, fast tests). Real gloo over loopback TCP, exactly as between processes."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False, timeout=DEFAULT_TIMEOUT)
    prefix = f"threads{id(store)}"
    comms = on_threads(world_size, lambda rank: connect("127.0.0.1", store.port, rank, world_size, backend, prefix,
                                                        timeout, store=store if rank == 0 else None))
    for c in comms:
        c._store = store  # keep the store (and its server) alive as long as the group
    return comms
