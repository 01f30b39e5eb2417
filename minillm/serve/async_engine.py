"""The engine behind a server: one thread steps the LLMEngine, and each request reads its outputs from an asyncio
queue of its own, so many concurrent HTTP requests share one continuous batch.

LLMEngine is not thread-safe, so only the engine thread touches it. `generate` and `abort` send commands that the
thread runs between two steps: a bad request fails in `add_request` (before it holds any KV block) and the error
reaches its caller; an abort (a client that went away) frees the request's blocks before the next step. Outputs go
back to the caller's event loop with `call_soon_threadsafe`. A step that raises (a worker rank that died, ...) ends
every request in flight with that error, and the engine refuses new ones (EngineDead) instead of hanging them.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence as Seq

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import RequestOutput
from minillm.sampling.params import SamplingParams


class EngineDead(RuntimeError):
    """The engine loop has stopped (closed, or a step failed): no request can run on it any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    prompt: str | Seq[int]
    params: SamplingParams
    request_id: str
    stream: _Stream
    accepted: concurrent.futures.Future


class AsyncEngine:
    """`async for out in engine.generate(prompt, params): ...` — each `out` is the request's RequestOutput after a
    step that advanced it (delta_text / delta_token_ids hold what the step added); the last one has
    `finished=True`. Leaving the loop early (a break, a cancelled task, a closed connection) aborts the request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._stopping = False
        self._closed = False                            # set (under _lock) once the loop has drained its commands
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="minillm-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side (event loop)
    async def submit(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> "RequestStream":
        """Queue a request and wait until the engine took it: add_request's error (a bad prompt, a schema that does
        not compile) is raised here, before anything is streamed. Iterate the result for the outputs; close it
        (`aclose`, or let it go) to abort the request."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Add(prompt, params if params is not None else SamplingParams(), rid, stream, accepted))
        await asyncio.wrap_future(accepted)
        return RequestStream(self, rid, stream)

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        outputs = await self.submit(prompt, params, request_id)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between two steps (to read engine state safely) and return its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Stop a request (its blocks are freed before the next step); unknown or finished ids are ignored."""
        try:
            self._send(("abort", str(request_id)))
        except EngineDead:                              # nothing runs any more: nothing to stop
            pass

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def close(self, timeout: float | None = None) -> None:
        """Stop the loop: requests in flight end with EngineDead. The LLMEngine itself stays open (its owner closes
        it)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, command) -> None:
        with self._lock:                                # never queued after the loop's last look at the queue
            if self._closed or self._error is not None or self._stopping:
                raise EngineDead(self._dead_reason())
            self._commands.put(command)
        self._wake.set()

    def _dead_reason(self) -> str:
        if self._error is not None:
            return f"the engine stopped after an error ({type(self._error).__name__}: {self._error})"
        return "the engine is shutting down"

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()                      # before reading commands: a later send sets it again
                self._apply_commands()
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out, out.finished)
                elif not self._stopping:
                    self._wake.wait()
        except BaseException as e:  # noqa: BLE001 -- every waiting request hears of it, not only a log
            self._error = e
        self._end_all()

    def _queued(self):
        """The commands sent so far, oldest first (without waiting for more)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for cmd in self._queued():
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif cmd[0] == "call":
                _run_into(cmd[2], cmd[1])
            else:
                self.engine.abort(cmd[1])
                self._streams.pop(cmd[1], None)

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id)
        except Exception as e:  # noqa: BLE001 -- the caller's error (bad prompt, id in use): it raises there
            cmd.accepted.set_exception(e)
            return
        self._streams[cmd.request_id] = cmd.stream
        cmd.accepted.set_result(cmd.request_id)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:                            # the caller's event loop is closed: nobody is listening
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    def _end_all(self) -> None:
        """Fail everything still waiting: streams in flight and adds not yet applied."""
        error = EngineDead(self._dead_reason())
        if self._error is not None:
            error.__cause__ = self._error
        for rid in list(self._streams):
            self._deliver(rid, error, True)
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 -- the engine may be what broke
                pass
        with self._lock:
            self._closed = True
        for cmd in self._queued():
            if isinstance(cmd, _Add):
                cmd.accepted.set_exception(error)
            elif cmd[0] == "call":
                cmd[2].set_exception(error)


def _run_into(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except Exception as e:  # noqa: BLE001 -- the caller's function failed: its caller hears why
        future.set_exception(e)


class RequestStream:
    """One request's outputs, in order; the last has finished=True. `aclose()` before the end aborts the request
    (so does dropping the stream unread: a handler that never started to stream leaks nothing)."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.engine, self.request_id, self._stream, self._done = engine, request_id, stream, False
        # True: when the reader fell behind, skip to the newest output (its text and token_ids hold everything the
        # skipped ones added; their delta_* fields are then not the whole change). A server that streams what is
        # new since it last sent sets this, so a slow client costs one message, not one per engine step.
        self.latest_only = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if self.latest_only:                            # outputs are cumulative: the newest says all the others do
            while not isinstance(item, BaseException) and not item.finished and not self._stream.queue.empty():
                item = self._stream.queue.get_nowait()
        if isinstance(item, BaseException):
            self._done = True                           # the loop dropped the request already
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- at interpreter exit the loop may be gone
            pass
