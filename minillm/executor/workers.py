"""The ranks of a parallel engine: rank 0 (the caller's process, which owns the scheduler, the block manager and
the sampler) and its workers, which own their shard of the model and of the KV pool and run whatever step rank 0
broadcasts.

    rank 0:   schedule -> send_step(inputs) -> forward(inputs) -> sample ...
    rank r:   loop { inputs = next step -> forward(inputs) }   until rank 0 sends STOP (or disappears)

Workers start as spawned processes ("mp"), threads of this process ("thread": real gloo over loopback, for
notebooks and fast tests), or are started by torchrun on one or several machines ("env").

One broadcast per step carries the step's inputs: rank 0 and the workers keep a buffer of the same capacity, and
a step that does not fit first broadcasts a GROW message (rare: the buffer only grows).
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minillm import config
from minillm.config import EngineConfig
from minillm.distributed.comm import DEFAULT_TIMEOUT, Communicator, connect, thread_communicators
from minillm.distributed.device import module_device, resolve_device
from minillm.distributed.sharding import stage_layers
from minillm.loading.loader import LoadedModel, load_model, peek_config
from minillm.worker.model_runner import StepInputs, build_runner

STEP, STOP, GROW, INIT = 1, 2, 3, 4
HEADER = 2
# Waiting for the next step is not a failure: a chat engine may sit idle for hours. A rank that dies closes its
# sockets and the others see that at once; this only bounds a rank that hangs while alive.
IDLE_TIMEOUT = datetime.timedelta(days=7)


class WorkerError(RuntimeError):
    """A rank of a parallel engine failed; the engine has been shut down."""


class StepChannel:
    """Rank 0 -> every rank: a command and an int64 payload, one broadcast when it fits the shared capacity."""

    def __init__(self, comm: Communicator, capacity: int = 1 << 12) -> None:
        self.comm, self.capacity = comm, capacity
        self.buf = torch.zeros(capacity, dtype=torch.int64)

    def send(self, cmd: int, payload: torch.Tensor | None = None) -> None:
        n = 0 if payload is None else payload.numel()
        if n + HEADER > self.capacity:
            new = max(2 * self.capacity, n + HEADER)
            self.buf[:HEADER] = torch.tensor([GROW, new])
            self.comm.broadcast(self.buf)
            self._grow(new)
        self.buf[0], self.buf[1] = cmd, n
        if n:
            self.buf[HEADER:HEADER + n] = payload
        self.comm.broadcast(self.buf)

    def recv(self) -> tuple[int, torch.Tensor]:
        while True:
            self.comm.broadcast(self.buf)
            cmd, n = int(self.buf[0]), int(self.buf[1])
            if cmd == GROW:
                self._grow(n)
                continue
            return cmd, self.buf[HEADER:HEADER + n].clone()

    def _grow(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf = torch.zeros(capacity, dtype=torch.int64)


@dataclass
class WorkerSpec:
    """What a worker needs to build its rank of the engine: the engine's own config (picklable, except `rules` in
    thread mode), with the few things that differ per launch."""
    model: str
    config: EngineConfig
    threads: int = 1
    rules: Any = None            # interfaces.TensorParallelRules; None: minillm's own
    dist_backend: str = "gloo"   # "nccl" when the engine runs on CUDA (one GPU per rank)

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size


def rank_device(spec: WorkerSpec, local_rank: int) -> torch.device:
    """The device of a rank: on CUDA the GPU of its rank on this machine (made the thread's current device, which
    NCCL uses), else the CPU."""
    device = resolve_device(spec.config.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def load_rank(spec: WorkerSpec, comm: Communicator, device: torch.device | None = None) -> LoadedModel:
    """This rank's shard of the model on `device` (default: the CPU): its tensor-parallel slice, or its pipeline
    stage's layers."""
    cfg, par = spec.config, spec.config.parallel
    quantization = effective_quantization(cfg, spec.rules)
    device = torch.device("cpu") if device is None else device
    if par.pipeline_parallel_size > 1:
        layers = stage_layers(peek_config(spec.model).num_layers, par.pipeline_parallel_size, comm.rank)
        return load_model(spec.model, cfg.dtype, None, layers, quantization=quantization,
                          group_size=cfg.quantization_group_size, device=device)
    return load_model(spec.model, cfg.dtype, comm, None, spec.rules, quantization=quantization,
                      group_size=cfg.quantization_group_size, device=device)


def effective_quantization(config: EngineConfig, rules: Any) -> str:
    """A learner's tensor-parallel rules take float weights: "auto" means float for them (int8/int4 are refused)."""
    return "none" if rules is not None and config.quantization == "auto" else config.quantization


def serve_steps(spec: WorkerSpec, comm: Communicator, model) -> None:
    """A worker's life after loading: take the pool size, then run every step rank 0 sends until STOP."""
    chan = StepChannel(comm)
    cmd, payload = chan.recv()
    if cmd == STOP:
        return
    assert cmd == INIT, cmd
    runner = build_runner(model, spec.config, int(payload[0]), comm, device=module_device(model))
    while True:
        cmd, payload = chan.recv()
        if cmd == STOP:
            return
        runner.forward(StepInputs.unpack(payload))


def _watch_parent(parent: int) -> None:
    """Exit when the process that started us is gone (it may have been killed without a word)."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)
    threading.Thread(target=watch, daemon=True, name="minillm-parent-watch").start()


def _process_main(spec: WorkerSpec, rank: int, port: int, parent: int) -> None:
    """Entry point of a spawned worker process."""
    _watch_parent(parent)
    torch.set_num_threads(max(1, spec.threads))
    store = dist.TCPStore("127.0.0.1", port, spec.world_size, False, timeout=DEFAULT_TIMEOUT)
    try:
        store.set(f"joined/{rank}", "1")
        device = rank_device(spec, rank)
        comm = connect("127.0.0.1", port, rank, spec.world_size, spec.dist_backend, store=store,
                       timeout=IDLE_TIMEOUT)
        model = load_rank(spec, comm, device).model
        serve_steps(spec, comm, model)
    except BaseException as e:  # noqa: BLE001 -- rank 0 reads this to say what went wrong
        try:
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}{_where(e)}")
        except Exception:  # noqa: BLE001 -- rank 0 is gone too: nobody else will say it
            raise e from None
        # Reported: rank 0's one error names this rank and the cause. A traceback here too would print the same
        # failure again (once per dying rank), interleaved with rank 0's output.
        sys.exit(1)


def _where(e: BaseException) -> str:
    """Where the error was raised (its innermost frame), for the one-line report rank 0 prints."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" (raised at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""


class Workers:
    """Rank 0's handle on the other ranks: starts them, broadcasts steps, notices failures, shuts them down."""

    def __init__(self, spec: WorkerSpec, backend: str) -> None:
        self.spec, self.backend = spec, backend
        self.procs: list[Any] = []
        self.threads: list[threading.Thread] = []
        self.thread_errors: dict[int, BaseException] = {}
        self.store = None
        self.comm: Communicator | None = None
        self.closed = False
        world = spec.world_size
        if backend == "mp":
            self.comm = self._start_processes()
        elif backend == "thread":
            self.comm = self._start_threads()
        elif backend == "env":
            self.comm = self._join_env()
        else:
            raise ValueError(f"unknown distributed_executor_backend {backend!r}")
        if self.comm.world_size != world:
            raise ValueError(f"the group has {self.comm.world_size} ranks but tensor_parallel_size x "
                             f"pipeline_parallel_size = {world}")
        self.chan = StepChannel(self.comm)
        _live.add(self)

    # ------------------------------------------------------------------ start
    def _start_processes(self) -> Communicator:
        import torch.multiprocessing as mp
        spec = self.spec
        store = dist.TCPStore("127.0.0.1", 0, spec.world_size, True, wait_for_workers=False, timeout=DEFAULT_TIMEOUT)
        self.store = store
        ctx = mp.get_context("spawn")
        for rank in range(1, spec.world_size):
            p = ctx.Process(target=_process_main, args=(spec, rank, store.port, os.getpid()), daemon=True,
                            name=f"minillm-rank{rank}")
            p.start()
            self.procs.append(p)
        self._wait_joined(store)
        return connect("127.0.0.1", store.port, 0, spec.world_size, spec.dist_backend, store=store,
                       timeout=IDLE_TIMEOUT)

    def _wait_joined(self, store) -> None:
        """Wait for every worker to reach the rendezvous, noticing one that died on the way (a bad import, ...)."""
        keys = [f"joined/{r}" for r in range(1, self.spec.world_size)]
        deadline = time.monotonic() + DEFAULT_TIMEOUT.total_seconds()
        while True:
            dead = [p for p in self.procs if not p.is_alive()]
            if dead:
                self.close(graceful=False)
                raise WorkerError(f"worker process {dead[0].name} exited with code {dead[0].exitcode} while "
                                  f"starting{self._errors_text()}. Workers are spawned and re-import the main "
                                  "script: in a script, create the LLM under `if __name__ == '__main__':` (in a "
                                  "notebook, use distributed_executor_backend='thread')")
            if store.check(keys):
                return
            if time.monotonic() > deadline:
                self.close(graceful=False)
                raise WorkerError(f"workers did not start in {DEFAULT_TIMEOUT.total_seconds():g} s: on a loaded "
                                  "machine give them longer with MINILLM_DIST_TIMEOUT=<seconds>")
            time.sleep(0.05)

    def _start_threads(self) -> Communicator:
        spec = self.spec
        comms = thread_communicators(spec.world_size, spec.dist_backend, IDLE_TIMEOUT)

        def run(rank: int) -> None:
            try:
                model = load_rank(spec, comms[rank], rank_device(spec, rank)).model
                serve_steps(spec, comms[rank], model)
            except BaseException as e:  # noqa: BLE001 -- reported by failure()
                self.thread_errors[rank] = e
            finally:
                comms[rank].release()    # like a process exiting: the other ranks see the group break
        for rank in range(1, spec.world_size):
            t = threading.Thread(target=run, args=(rank,), daemon=True, name=f"minillm-rank{rank}")
            t.start()
            self.threads.append(t)
        return comms[0]

    def _join_env(self) -> Communicator:
        comm, self.store = env_communicator(self.spec)
        if comm.rank != 0:
            raise RuntimeError("only rank 0 drives the engine")
        return comm

    # ------------------------------------------------------------------ run
    def init(self, num_blocks: int) -> None:
        self.chan.send(INIT, torch.tensor([num_blocks]))

    def send_step(self, inputs) -> None:
        if self.closed:
            raise WorkerError("this parallel engine has been shut down (a worker failed or close() was called): "
                              "create a new LLM")
        try:
            self.chan.send(STEP, inputs.pack())
        except RuntimeError as e:
            raise self.failure(e) from e

    def failure(self, exc: BaseException) -> WorkerError:
        """Turn a failed collective into one clear error naming the rank that went away, and shut everything
        down (a half-dead group can never step again)."""
        time.sleep(0.2)   # let a dying process finish dying, so its exit code is known
        dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]
        dead += [f"minillm-rank{r} ({type(e).__name__}: {e})" for r, e in self.thread_errors.items()]
        errors = self._errors_text()
        self.close(graceful=False)
        who = ", ".join(dead) if dead else "a rank"
        # the broken collective only matters when no rank said why (gloo's "Connection closed by peer" otherwise)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        collective = "" if errors else f" (collective error: {first})"
        return WorkerError(f"{who} of the parallel engine failed during a step{errors}; the engine is shut down "
                           f"and its workers stopped. Create a new LLM to continue.{collective}")

    def _errors_text(self) -> str:
        if self.store is None:
            return ""
        found = []
        for r in range(1, self.spec.world_size):
            try:
                if self.store.check([f"error/{r}"]):
                    found.append(f"rank {r}: {self.store.get(f'error/{r}').decode()}")
            except Exception:  # noqa: BLE001
                pass
        return (": " + "; ".join(found)) if found else ""

    # ------------------------------------------------------------------ stop
    def close(self, graceful: bool = True) -> None:
        """Stop every worker and wait for it; nothing is left running afterwards."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.chan.send(STOP)
            except Exception:  # noqa: BLE001 -- a worker already gone: terminate below
                pass
        for p in self.procs:
            p.join(timeout=10 if graceful else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if self.comm is not None and (not graceful or self.threads):
            self.comm.release()
        for t in self.threads:
            t.join(timeout=10 if graceful else 1)
        _live.discard(self)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


_live: "weakref.WeakSet[Workers]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for w in list(_live):
        w.close()


def env_communicator(spec: WorkerSpec):
    """(Communicator, store) of this process in the group torchrun (or another env:// launcher) set up."""
    store, rank, world = next(dist.rendezvous("env://", timeout=DEFAULT_TIMEOUT))
    if world != spec.world_size:
        raise ValueError(f"torchrun started {world} processes but tensor_parallel_size x pipeline_parallel_size = "
                         f"{spec.world_size}: give torchrun --nnodes x --nproc-per-node = {spec.world_size}")
    return connect("", 0, rank, world, spec.dist_backend, store=store, timeout=IDLE_TIMEOUT), store


def run_env_worker(spec: WorkerSpec) -> None:
    """A torchrun rank other than 0: join the group, load this rank's shard, serve steps until rank 0 stops."""
    device = rank_device(spec, config.torchrun_local_rank())
    comm, _ = env_communicator(spec)
    torch.set_num_threads(max(1, spec.threads))
    serve_steps(spec, comm, load_rank(spec, comm, device).model)


def env_rank() -> int | None:
    """This process's rank when torchrun (or another env:// launcher) started it, else None."""
    return config.torchrun_rank()
