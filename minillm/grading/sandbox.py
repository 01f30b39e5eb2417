"""The sandbox of trusted grading: a fresh interpreter that holds the learner's answer and nothing of the grader's.

`Sandbox.start()` launches `python -I -m minillm.grading.sandbox FD` in an empty temporary folder (-I: the
notebook's folder, PYTHONPATH and user site-packages are not on sys.path, so a `minillm/` beside the notebook
shadows nothing). The process imports torch and waits. `load(engine, payload)` then, in this order:

1. replaces minillm's own implementation of the graded piece (`engine`: "module:qualname" paths) with a stub that
   raises, in place (the function's code object too, so every alias of it runs the stub): delegating to it, under
   any name, by a thread or without a tracer, fails;
2. refuses, from then on, imports of the graders and fixtures (minillm.grading's lab modules, minillm.testing),
   reading their files or the stubbed modules' files, loading minillm's compiled kernels with ctypes, and signals
   to any other process;
3. unpickles the answer (cloudpickle's bytes, taken from the notebook's kernel) and answers with its description.

From then on it serves the grader's requests (wire.Channel) until the grader closes the socket. It never sees an
expected value: the checker's inputs arrive as arguments, its oracle stays in the grader's process, and whatever
the sandbox answers is checked there.
"""
from __future__ import annotations

import inspect
import os
import pickle
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
from typing import Any

from minillm import config
from minillm.grading import core, wire

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))       # .../minillm
_SEALED_MODULES = ("minillm.grading.lab", "minillm.testing", "minillm.grading.core", "minillm.grading.trusted",
                   "minillm.grading.cli")


# --------------------------------------------------------------------------- the grader's side

class Sandbox:
    """A sandbox process and the grader's end of its channel."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.tmp = tempfile.TemporaryDirectory(prefix="minillm-sandbox-")
        self.stderr = open(os.path.join(self.tmp.name, "stderr"), "w+")
        self.proc = subprocess.Popen([sys.executable, "-I", "-m", "minillm.grading.sandbox", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), cwd=self.tmp.name, stdin=subprocess.DEVNULL,
                                     stdout=self.stderr, stderr=self.stderr, env=_sandbox_env())
        theirs.close()
        self.channel = wire.Channel(ours, trusted_peer=False)

    def load(self, engine: list[str], payload: bytes) -> tuple[wire.Proxy, dict]:
        """Stub the engine's piece, unpickle the answer: (a proxy of it, its description)."""
        oid, description = self.channel.request(0, "call", ("load", engine, payload))
        return self.channel.proxy(oid), description

    def ended(self) -> str:
        """How the process ended ("exit status 0", "signal SIGSEGV"), or "" while it runs."""
        code = self.proc.poll()
        if code is None:
            try:
                code = self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return ""
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"

    def where(self) -> str:
        """Where the learner's code is running now ("in f, line 3"), asked with SIGUSR1 (a check that timed out)."""
        path = os.path.join(self.tmp.name, "where")
        if self.proc.poll() is not None:
            return ""
        self.proc.send_signal(signal.SIGUSR1)
        for _ in range(50):
            if os.path.exists(path):
                with open(path) as f:
                    return f.read()
            time.sleep(0.02)
        return ""

    def errors(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()[-2000:]

    def close(self) -> None:
        self.channel.closed = True
        try:
            self.channel.sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.stderr.close()
            self.tmp.cleanup()


def _sandbox_env() -> dict[str, str]:
    return config.child_env(TRITON_INTERPRET="1")


# --------------------------------------------------------------------------- the sandbox's side

def _stub(message: str, freevars: int) -> types.CodeType:
    """A code object that raises RuntimeError(message), with `freevars` free variables (a function's __code__
    can only be replaced by code with as many)."""
    names = [f"_v{i}" for i in range(freevars)]
    touch = ", ".join(names) + " = " + ", ".join(names) if names else "pass"        # uses the free variables
    inner = f"    def stub(*args, **kwargs):\n        {touch}" \
            f"\n        raise RuntimeError({message!r})\n"
    src = "def outer():\n" + "".join(f"    {n} = None\n" for n in names) + inner + "    return stub\n"
    space: dict = {}
    exec(compile(src, "<minillm sandbox>", "exec"), space)
    return space["outer"]().__code__


def _replace(fn: Any, message: str) -> None:
    fn = inspect.unwrap(fn)
    fn = getattr(fn, "fn", fn)           # a Triton kernel: its Python function
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if isinstance(fn, property):
        for f in (fn.fget, fn.fset, fn.fdel):
            if f is not None:
                _replace(f, message)
        return
    if isinstance(fn, types.FunctionType):
        fn.__code__ = _stub(message, len(fn.__code__.co_freevars))


def _replace_kernel(kernel: Any, message: str) -> None:
    """A Triton kernel runs in the interpreter from its source text: replace that (and its function)."""
    _replace(kernel.fn, message)
    params = ", ".join(kernel.arg_names)
    kernel.src = f"def {kernel.fn.__name__}({params}):\n    raise RuntimeError({message!r})\n"


def stub_engine(paths: list[str]) -> list[str]:
    """Replace each "module:qualname" object with a stub; returns the files whose reading is refused."""
    files = []
    for path, obj in zip(paths, core.resolve(paths)):
        module_name, _, qualname = path.partition(":")
        files.append(os.path.realpath(sys.modules[module_name].__file__))
        message = (f"minillm's own {qualname} is not available while your answer is graded: the answer must "
                   "compute this with your own code.")
        if isinstance(obj, type):
            for value in list(vars(obj).values()):
                _replace(value, message)
        elif inspect.isfunction(getattr(obj, "fn", None)) and hasattr(obj, "src"):
            _replace_kernel(obj, message)
        else:
            _replace(obj, message)
    return files


class _Refuse:
    """A meta-path finder that refuses the graders' and fixtures' modules."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> None:
        if name.startswith(_SEALED_MODULES):
            raise ImportError(f"{name} is not available while an answer is graded")
        return None


def seal(files: list[str]) -> None:
    """From now on: no graders, no engine sources of the piece, no minillm kernels by ctypes, no signals out."""
    for name in [m for m in sys.modules if m.startswith(_SEALED_MODULES)]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Refuse())
    stems = {os.path.splitext(os.path.basename(f))[0] for f in files}
    grading = os.path.join(_PACKAGE, "grading") + os.sep
    testing = os.path.join(_PACKAGE, "testing.py")
    me = os.getpid()
    parent = f"/proc/{os.getppid()}"

    def refused(path: str) -> bool:
        real = os.path.realpath(path)
        if real.startswith(grading) and not real.endswith(("wire.py", "sandbox.py", "__init__.py")):
            return True
        if real == testing or real.startswith(parent + os.sep) or real == parent:
            return True
        if real.startswith(_PACKAGE + os.sep) and os.path.basename(real).split(".")[0] in stems:
            return True
        return False

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if refused(path):
                raise PermissionError(f"{path} cannot be read while an answer is graded")
        elif event == "ctypes.dlopen" and args and "minillm" in str(args[0]):
            raise PermissionError("minillm's compiled kernels cannot be loaded while an answer is graded")
        elif event in ("os.kill", "os.killpg") and args and args[0] not in (me, 0):
            raise PermissionError("an answer cannot signal other processes")

    sys.addaudithook(hook)


def describe(obj: Any) -> dict:
    """What the grader needs to stand in for the answer: its name, kind and (for a class) its members."""
    if isinstance(obj, type):
        members = {}
        for klass in reversed([k for k in obj.__mro__ if not wire.is_minillm(k.__module__) and k is not object]):
            for name, value in vars(klass).items():
                if name in ("__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"):
                    continue
                members[name] = _member_kind(value)
        return {"kind": "class", "name": obj.__name__, "members": members}
    fn = getattr(obj, "fn", None)
    if inspect.isfunction(fn):                       # a Triton kernel (its source came along: emit)
        return {"kind": "kernel", "name": fn.__name__, "params": _params(fn), "source": None}
    if callable(obj):
        return {"kind": "function", "name": getattr(obj, "__name__", type(obj).__name__), "params": _params(obj)}
    return {"kind": "value", "name": type(obj).__name__}


def _member_kind(value: Any) -> str:
    if isinstance(value, staticmethod):
        return "static"
    if isinstance(value, classmethod):
        return "classmethod"
    if isinstance(value, property):
        return "property"
    if isinstance(value, type):
        return "class"
    if inspect.isfunction(value) or callable(value):
        return "method"
    return "data"


def _params(fn: Any) -> list[tuple[str, str]]:
    try:
        return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return []


class _Host:
    """Object 0 of the sandbox's channel: the grader's first request loads the answer."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel

    def __call__(self, what: str, engine: list[str], payload: bytes) -> tuple[int, dict]:
        refs = core.fingerprints(core.resolve(engine))     # for the copy note, before the engine's code is stubbed
        seal(stub_engine(engine))
        answer, source = pickle.loads(payload), None
        if isinstance(answer, tuple) and len(answer) == 3 and answer[0] == "minillm-answer/1":
            _, answer, source = answer             # as emitted from a notebook (a kernel's source comes along)
        description = describe(answer)
        if source is not None:
            description["source"] = source
        description["note"] = core.copy_note(answer, refs)
        return self.channel.export(answer), description


    def call_seeded(self, fn: Any, rng_state: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """fn(*args, **kwargs) with torch's global generator in the grader's state, and its state after: an
        answer that draws from the global generator (generator=None) consumes the grader's stream."""
        import torch
        torch.set_rng_state(rng_state)
        return fn(*args, **kwargs), torch.get_rng_state()


def _say_where(signum: int, frame: types.FrameType | None) -> None:
    """SIGUSR1: write where the learner's code is running to ./where (the grader's time limit ran out)."""
    while frame is not None and frame.f_code.co_filename.startswith(wire.LIBRARY_PREFIXES):
        frame = frame.f_back
    with open("where.part", "w") as f:
        f.write(f"in {frame.f_code.co_name}, line {frame.f_lineno}" if frame is not None else "")
    os.replace("where.part", "where")


def main(fd: int) -> int:
    import numpy  # noqa: F401 — loaded before any answer, like torch
    import torch  # noqa: F401
    wire.LIBRARY_PREFIXES = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                                   for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {_PACKAGE + os.sep})
    channel = wire.Channel(socket.socket(fileno=fd), trusted_peer=True)
    channel.export(_Host(channel), oid=0)
    signal.signal(signal.SIGUSR1, _say_where)
    threading.excepthook = lambda args: None          # a learner's thread dies quietly
    channel.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
