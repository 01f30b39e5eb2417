"""The channel between the trusted grader and the sandbox that runs a learner's code: calls both ways, by value or
by reference.

One socket, one pickle per message, strictly nested calls: a side that waits for its reply serves the other side's
requests meanwhile, so the learner's method can call back into the grader's objects (`self.block_manager.free`)
while the grader waits for that method to return.

What crosses by value (a copy): None, bool, numbers, str/bytes, tuples, lists, dicts, sets, tensors (storage,
offset, size, stride and dtype, aliases kept within one message), numpy arrays, torch.Generator states, enums,
frozen dataclasses, named tuples and the data classes in VALUE_CLASSES. Everything else crosses as a reference: the
other side gets a `Proxy` whose attribute reads, calls, item access, iteration, comparisons and operators are
requests served where the object lives. A mutable container read as an attribute of a referenced object
(`self.running`) crosses by reference too, so that the learner's `append` changes the grader's list.

After a call, the side that ran it sends back the arguments it changed in place (tensors, generators' states,
lists, dicts), and the caller copies them into its own: an in-place kernel output, a consumed random generator.

Trust runs one way. The sandbox unpickles what the grader sends with the full pickle machinery; the grader reads
what the sandbox sends with `SafeUnpickler`, which builds only the value types above: no other class is looked up,
no function runs. Names starting with `__` are never served (no `__globals__`, `__class__` or `__dict__` walk into
the other process), and a module never crosses.
"""
from __future__ import annotations

import collections
import copyreg
import dataclasses
import enum
import io
import itertools
import operator
import pickle
import socket
import struct
import sys
import threading
import types
from typing import Any

import numpy as np
import torch

VALUE_CLASSES = frozenset({"minillm.structured.automata.DFA", "minillm.structured.token_index.TokenIndex",
                           "minillm.fleet.workloads.SimRequest",
                           "minillm.quant.formats.QuantizedWeight", "minillm.structured.token_index.VocabTrie"})

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)}
_BUILTINS = frozenset({"set", "frozenset", "complex", "slice", "range", "bytearray", "getattr"})
_OPERATORS = frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "and_",
                        "or_", "xor", "invert", "lshift", "rshift", "matmul", "iadd", "isub", "imul", "itruediv",
                        "ifloordiv", "imod", "iand", "ior", "ixor", "eq", "ne", "lt", "le", "gt", "ge",
                        "contains", "getitem", "setitem", "delitem", "index"})


class ChannelClosed(BaseException):
    """The other process is gone (it exited, crashed or was killed). A BaseException: a learner's
    `except Exception` cannot swallow it, and hypothesis does not shrink on it."""


class Ended(ChannelClosed):
    """The learner's code ended the sandbox process itself (sys.exit, os._exit, a crash)."""


class RemoteError(Exception):
    """An exception of a type that does not cross (the learner's own class): its name and message."""


def is_minillm(module: str | None) -> bool:
    return isinstance(module, str) and (module == "minillm" or module.startswith("minillm."))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


SEALED = ("minillm.grading", "minillm.testing")      # modules the sandbox cannot import: their objects go by reference


def _global(obj: Any) -> bool:
    """A class or function the other side can import by name (pickled as a global: its own copy of it)."""
    if not isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        return False
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str) or module == "__main__" or module.startswith(SEALED) or module not in sys.modules:
        return False
    owner = sys.modules[module]
    found = owner
    for part in getattr(obj, "__qualname__", "<").split("."):
        found = getattr(found, part, None)
    return found is obj


def by_value(obj: Any) -> bool:
    """Does obj cross as a copy?"""
    t = type(obj)
    if t in (type(None), bool, int, float, complex, str, bytes, bytearray, tuple, list, dict, set, frozenset,
             slice, range, torch.Size, collections.OrderedDict, collections.deque):
        return True
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic, torch.Generator, torch.dtype, torch.device,
                        enum.Enum)):
        return True
    if dataclasses.is_dataclass(t) and (t.__dataclass_params__.frozen or _qualified(t) in VALUE_CLASSES):
        return True
    return isinstance(obj, tuple) and hasattr(t, "_fields")


# --------------------------------------------------------------------------- pickling with references

def _tensor_state(t: torch.Tensor, memo: dict) -> tuple:
    """A tensor as its storage's bytes (once per message: views of one storage stay views of one storage), offset,
    size, stride and dtype."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    storage = t.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    data = None
    if key not in memo:
        memo[key] = len(memo)
        data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()
    return ("t", memo[key], data, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()),
            t.storage_offset())


_ATOMS = frozenset((type(None), bool, int, float, str, bytes, tuple))


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, channel: "Channel", shared: Any = None) -> None:
        super().__init__(file, protocol=5)
        self.ch, self.shared, self.memo_storage = channel, shared, {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _ATOMS:     # most of a message: none of the checks below applies to them (each costs)
            return None
        if isinstance(obj, (Proxy, Method)):
            if obj._ch is not self.ch:
                raise pickle.PicklingError("a reference of another channel cannot be sent")
            return ("back", obj._oid) if isinstance(obj, Proxy) else ("backmethod", obj._owner._oid, obj._name)
        if isinstance(obj, (types.MethodType, types.BuiltinMethodType)) and obj.__name__[:2] != "__" and \
                not isinstance(getattr(obj, "__self__", None), (type, types.ModuleType, type(None))):
            return ("method", self.ch.export(obj.__self__), obj.__name__)
        if obj is self.shared and isinstance(obj, (list, dict, set, collections.deque)):
            return ("ref", self.ch.export(obj))
        if isinstance(obj, torch.Tensor):
            return _tensor_state(obj, self.memo_storage)
        if isinstance(obj, torch.Generator):
            return ("g", bytes(obj.get_state().numpy()), str(obj.device))
        if isinstance(obj, torch.dtype):
            return ("dtype", str(obj).removeprefix("torch."))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            return ("nd", a.dtype.str, a.shape, a.tobytes())
        if isinstance(obj, np.generic):
            return ("np", obj.dtype.str, obj.tobytes())
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__)
        if by_value(obj) or _global(obj):
            return None
        return ("ref", self.ch.export(obj))


class _Unpickler(pickle.Unpickler):
    """The sandbox's reader: the grader is trusted, any class may be built."""

    def __init__(self, file: io.BytesIO, channel: "Channel") -> None:
        super().__init__(file)
        self.ch, self.storages, self.resolved = channel, {}, set()

    def persistent_load(self, pid: tuple) -> Any:
        kind = pid[0]
        if kind == "t":
            _, index, data, dtype, shape, stride, offset = pid
            if data is not None:
                self.storages[index] = torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage() \
                    if data else torch.UntypedStorage(0)
            if dtype not in _DTYPES or index not in self.storages:
                raise pickle.UnpicklingError(f"a tensor of dtype {dtype} cannot cross")
            out = torch.empty(0, dtype=_DTYPES[dtype])
            return out.set_(self.storages[index], offset, shape, stride)
        if kind == "g":
            g = torch.Generator(device=pid[2])
            g.set_state(torch.frombuffer(bytearray(pid[1]), dtype=torch.uint8))
            return g
        if kind == "dtype":
            return _DTYPES[pid[1]]
        if kind == "device":
            return torch.device(pid[1])
        if kind == "nd":
            return np.frombuffer(bytearray(pid[3]), dtype=np.dtype(pid[1])).reshape(pid[2])
        if kind == "np":
            return np.frombuffer(pid[2], dtype=np.dtype(pid[1]))[0]
        if kind == "module":
            return self.module(pid[1])
        if kind == "back":
            obj = self.ch.objects[pid[1]]
            self.resolved.add(id(obj))
            return obj
        if kind == "backmethod":
            return getattr(self.ch.objects[pid[1]], pid[2])
        if kind == "method":
            self.ch.methods.add((pid[1], pid[2]))
            return Method(self.ch.proxy(pid[1]), pid[2])
        if kind == "ref":
            return self.ch.proxy(pid[1])
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")

    def module(self, name: str) -> Any:
        return sys.modules.get(name) or __import__(name)


class SafeUnpickler(_Unpickler):
    """The grader's reader of what the sandbox sends: only value types are built (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS:
            return getattr(__import__("builtins"), name)
        if module == "collections" and name in ("OrderedDict", "deque"):
            return getattr(collections, name)
        if module == "copyreg" and name in ("_reconstructor", "__newobj__"):
            return getattr(copyreg, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if is_minillm(module) and module in sys.modules:
            obj = getattr(sys.modules[module], name, None)
            if isinstance(obj, type) and (issubclass(obj, (enum.Enum, BaseException)) or by_value_class(obj)):
                return obj
        raise pickle.UnpicklingError(f"the grader does not accept a {module}.{name} from the sandbox")

    def module(self, name: str) -> Any:
        raise pickle.UnpicklingError(f"a module ({name}) cannot come back from the sandbox")


def by_value_class(cls: type) -> bool:
    if dataclasses.is_dataclass(cls):
        return cls.__dataclass_params__.frozen or _qualified(cls) in VALUE_CLASSES
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


# --------------------------------------------------------------------------- in-place changes of arguments

def _mutables(value: Any, out: list, skip: set, depth: int = 0) -> list:
    """The objects of a call's arguments a callee may change in place, in a fixed order (skip: ids of objects
    that are the callee's own, lent to the caller and sent back)."""
    if depth > 4 or id(value) in skip:
        return out
    if isinstance(value, (torch.Tensor, torch.Generator, bytearray)):
        out.append(value)
    elif isinstance(value, (list, dict)) and not isinstance(value, Proxy):
        out.append(value)
        for v in (value.values() if isinstance(value, dict) else value):
            _mutables(v, out, skip, depth + 1)
    elif isinstance(value, tuple):
        for v in value:
            _mutables(v, out, skip, depth + 1)
    return out


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, bytearray):
        return bytes(value)
    return list(value) if isinstance(value, list) else dict(value)


def _changed(before: Any, now: Any) -> bool:
    if isinstance(now, torch.Tensor):
        return now.shape != before.shape or not torch.equal(now.detach(), before) if now.dtype == before.dtype \
            else True
    if isinstance(now, torch.Generator):
        return not torch.equal(now.get_state(), before)
    if isinstance(now, list):
        return len(now) != len(before) or any(a is not b for a, b in zip(now, before))
    if isinstance(now, dict):
        return now.keys() != before.keys() or any(now[k] is not before[k] for k in now)
    return bytes(now) != before


def _apply(target: Any, value: Any) -> None:
    """Copy what the callee left in an argument into the caller's own object (types checked: it may be the
    sandbox's word)."""
    if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        if value.shape == target.shape and value.dtype == target.dtype:
            with torch.no_grad():
                target.copy_(value)
    elif isinstance(target, torch.Generator) and isinstance(value, torch.Generator):
        target.set_state(value.get_state())
    elif isinstance(target, list) and isinstance(value, list):
        target[:] = value
    elif isinstance(target, dict) and isinstance(value, dict):
        target.clear()
        target.update(value)
    elif isinstance(target, bytearray) and isinstance(value, (bytes, bytearray)):
        target[:] = value


# --------------------------------------------------------------------------- the channel

_FRAME = struct.Struct("!Q")


class Channel:
    """One side of the socket. `objects` holds what this side lent the other (by id) for the channel's life."""

    def __init__(self, sock: socket.socket, trusted_peer: bool) -> None:
        self.sock, self.trusted_peer = sock, trusted_peer
        self.objects: dict[int, Any] = {}
        self.oid_of: dict[int, int] = {}
        self.proxies: dict[int, Proxy] = {}
        self.methods: set[tuple[int, str]] = set()    # (object, name) the other side said is a method: one request
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.closed = False
        self.held: BaseException | None = None     # a verdict raised by our code while serving: re-raised on return

    def proxy(self, oid: int) -> "Proxy":
        """The one Proxy of the other side's object `oid` (one per object: `a is b` holds across the channel)."""
        found = self.proxies.get(oid)
        if found is None:
            found = self.proxies[oid] = Proxy(self, oid)
        return found

    def export(self, obj: Any, oid: int | None = None) -> int:
        """Lend obj to the other side (kept alive for the channel's life); its id there."""
        oid = self.oid_of.get(id(obj)) if oid is None else oid
        if oid is None:
            oid = id(obj)
        self.objects[oid], self.oid_of[id(obj)] = obj, oid
        return oid

    # ---- framing
    def _send(self, message: tuple, shared: Any = None) -> None:
        buf = io.BytesIO()
        _Pickler(buf, self, shared).dump(message)
        data = buf.getvalue()
        try:
            self.sock.sendall(_FRAME.pack(len(data)) + data)
        except OSError:
            self.closed = True
            raise ChannelClosed("the other process is gone") from None

    def _recv(self) -> tuple:
        head = self._read(_FRAME.size)
        data = self._read(_FRAME.unpack(head)[0])
        reader = (_Unpickler if self.trusted_peer else SafeUnpickler)(io.BytesIO(data), self)
        message = reader.load()
        self.resolved = reader.resolved        # our own objects among the arguments: not the callee's to copy back
        return message

    def _read(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            try:
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                raise ChannelClosed("the other process is gone")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def serve_forever(self) -> None:
        """Serve the other side's requests until it closes the channel (the sandbox's main loop)."""
        try:
            while True:
                self._serve(self._recv())
        except ChannelClosed:
            return

    # ---- calls
    def request(self, oid: int, op: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.closed:
            raise ChannelClosed("the other process is gone")
        self._send(("req", oid, op, args, kwargs or {}))
        while True:
            try:
                message = self._recv()
            except pickle.UnpicklingError as e:
                self.closed = True
                raise RemoteError(f"the sandbox sent something the grader does not accept: {e}") from None
            except BaseException:
                self.closed = True       # interrupted mid-call (a time limit): the other side's state is unknown
                raise
            if message[0] == "req":
                self._serve(message)
                continue
            kind, payload, changes = message[1], message[2], message[3]
            # the same walk as the other side's, once per reply (once per change made it quadratic: a call drawing
            # for a batch of a few thousand generators spent a minute here)
            targets = _mutables((args, kwargs or {}), [], set()) if changes else []
            for index, value in changes:
                if 0 <= index < len(targets):
                    _apply(targets[index], value)
            if self.held is not None and not self.trusted_peer:
                held, self.held = self.held, None
                raise held
            if kind == "ok":
                return payload
            raise self._exception(payload)

    def _serve(self, message: tuple) -> None:
        _, oid, op, args, kwargs = message
        watched = _mutables((args, kwargs), [], self.resolved)
        before = [_snapshot(m) for m in watched]
        try:
            value = self._perform(oid, op, args, kwargs)
            kind = "ok"
        except ChannelClosed:
            raise
        except BaseException as e:  # noqa: BLE001 — every outcome travels back, the other side decides
            kind, value = "err", self._describe(e)
            if not self.trusted_peer and (not isinstance(e, Exception) or isinstance(e, AssertionError)):
                self.held = e        # a verdict of the grader's (or its time limit): the learner cannot catch it
        changes = [(i, m) for i, (m, b) in enumerate(zip(watched, before)) if _changed(b, m)]
        # the grader lends a container it returns (the learner's append must reach it); the sandbox's results are
        # values for the checker
        self._send(("rep", kind, value, changes), shared=value if kind == "ok" and not self.trusted_peer else None)

    def _perform(self, oid: int, op: str, args: tuple, kwargs: dict) -> Any:
        obj = self.objects[oid]
        if op == "call":
            return obj(*args, **kwargs)
        if op in ("getattr", "setattr", "delattr"):
            name = args[0]
            if not isinstance(name, str) or name.startswith("__"):
                raise AttributeError(f"{name!r} is not served across processes")
            return getattr(obj, name) if op == "getattr" else \
                setattr(obj, name, args[1]) if op == "setattr" else delattr(obj, name)
        if op == "callmethod":
            name = args[0]
            if not isinstance(name, str) or name.startswith("__"):
                raise AttributeError(f"{name!r} is not served across processes")
            return getattr(obj, name)(*args[1:], **kwargs)
        if op == "mapmethod":
            fn = self._perform(oid, "getattr", args[:1], {})
            return [fn(v) for v in args[1]]
        if op == "rop":
            return getattr(operator, args[0])(args[1], obj)
        if op == "iter":
            return iter(obj)
        if op == "next":
            return next(obj)
        if op in ("len", "bool", "hash", "repr", "str", "int", "float"):
            return {"len": len, "bool": bool, "hash": hash, "repr": repr, "str": str, "int": int,
                    "float": float}[op](obj)
        if op in _OPERATORS:
            return getattr(operator, op)(obj, *args)
        raise AttributeError(f"operation {op!r} is not served")

    def _describe(self, e: BaseException) -> tuple:
        """(module, type name, message, where, caused by NotImplementedError) of an exception."""
        cause, seen = e.__cause__ or e.__context__, False
        while cause is not None:
            seen = seen or isinstance(cause, NotImplementedError)
            cause = cause.__cause__ or cause.__context__
        text = str(e)
        return (type(e).__module__, type(e).__name__, text, getattr(e, "remote_where", None) or where(e), seen)

    def _exception(self, info: tuple) -> BaseException:
        module, name, text, at, not_implemented = info
        if module == "builtins" and name in ("SystemExit", "KeyboardInterrupt"):
            return Ended(f"{'sys.exit' if name == 'SystemExit' else 'KeyboardInterrupt'}({text})")
        cls = _exception_class(module, name)
        if cls is None:
            exc: BaseException = RemoteError(f"{name}: {text}" if text else name)
        else:
            try:
                exc = cls(text)
            except Exception:  # noqa: BLE001
                exc = RemoteError(f"{name}: {text}")
        exc.remote_where = at
        if not_implemented:
            exc.__cause__ = NotImplementedError()
        return exc


def _exception_class(module: str, name: str) -> type | None:
    if module == "builtins":
        cls = getattr(__import__("builtins"), name, None)
    elif is_minillm(module) and module in sys.modules and not module.startswith(("minillm.grading", "minillm.verdict")):
        cls = getattr(sys.modules[module], name, None)
    else:
        return None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return None
    return cls


LIBRARY_PREFIXES: tuple[str, ...] = ()


def where(e: BaseException) -> str:
    """' (in f, line N: `code`)' for the innermost frame of the traceback outside minillm and the libraries."""
    import traceback
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(LIBRARY_PREFIXES) or f.filename.startswith("<")]
    frames = [f for f in frames if not f.filename.startswith("<frozen")]
    if not frames:
        return ""
    f = frames[-1]
    line = (f.line or "").strip()
    return f" (in {f.name}, line {f.lineno}" + (f": `{line[:80]}`)" if line else ")")


# --------------------------------------------------------------------------- the proxy

class Proxy:
    """An object of the other process. Every use is a request there; names starting with `__` are not served."""

    __slots__ = ("_ch", "_oid")

    def __init__(self, channel: Channel, oid: int) -> None:
        object.__setattr__(self, "_ch", channel)
        object.__setattr__(self, "_oid", oid)

    def _do(self, op: str, *args: Any, **kwargs: Any) -> Any:
        return self._ch.request(self._oid, op, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if (self._oid, name) in self._ch.methods:
            return Method(self, name)
        return self._do("getattr", name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._do("setattr", name, value)

    def __delattr__(self, name: str) -> None:
        self._do("delattr", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ch.request(self._oid, "call", args, kwargs)

    def __repr__(self) -> str:
        try:
            return self._do("repr")
        except BaseException:  # noqa: BLE001 — a rendering of a dead proxy
            return "<object in the other process>"

    def __reduce__(self) -> Any:
        raise TypeError("an object of the other process cannot be pickled here")


def host(proxy: Proxy) -> Proxy:
    """Object 0 of the other side of `proxy`'s channel (the sandbox's host: it loads answers, calls them seeded)."""
    return proxy._ch.proxy(0)


class Method:
    """A bound method of an object of the other process: calling it is one request."""

    __slots__ = ("_owner", "_name", "_ch")

    def __init__(self, owner: Proxy, name: str) -> None:
        self._owner, self._name, self._ch = owner, name, owner._ch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ch.request(self._owner._oid, "callmethod", (self._name, *args), kwargs)

    def map_calls(self, values: Any) -> list:
        """[self(v) for v in values] in one request (a checker reading many small facts, e.g. every ref count)."""
        return self._ch.request(self._owner._oid, "mapmethod", (self._name, list(values)))

    def __repr__(self) -> str:
        return f"<method {self._name} of an object in the other process>"

    def __reduce__(self) -> Any:
        raise TypeError("a method of the other process cannot be pickled here")


def _operator(name: str) -> Any:
    def method(self: Proxy, *args: Any) -> Any:
        return self._do(name, *args)
    method.__name__ = f"__{name.rstrip('_')}__"
    return method


# len(), iter(), next(), bool(), hash(), str(), int(), float(), operator.index() and the operators: each a request
for _name in sorted(_OPERATORS | {"len", "iter", "next", "bool", "hash", "str", "int", "float"}):
    setattr(Proxy, f"__{_name.rstrip('_')}__", _operator(_name))
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "matmul", "and_", "or_", "xor"):
    def _reflected(self: Proxy, other: Any, _op: str = _name) -> Any:
        return self._ch.request(self._oid, "rop", (_op, other))
    setattr(Proxy, f"__r{_name.rstrip('_')}__", _reflected)
