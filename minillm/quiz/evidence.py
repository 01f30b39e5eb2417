"""Resolve a bank entry's `evidence`: every name must point at real code or a real command."""
from __future__ import annotations

import contextlib
import importlib
import io
import shlex


def resolve_evidence(ref: str) -> None:
    """Raise ValueError unless `ref` is an importable minillm name or a `minillm ...` command line
    that the CLI parser accepts."""
    if ref.startswith("minillm "):
        from minillm.cli import build_parser
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                build_parser().parse_args(shlex.split(ref)[1:])
        except SystemExit:
            raise ValueError(f"evidence {ref!r}: the minillm CLI does not accept this command") from None
        return
    if not ref.startswith("minillm."):
        raise ValueError(f"evidence {ref!r}: write a dotted name under minillm (minillm.kv.sizing.kv_cache_bytes) "
                         "or a command starting with 'minillm '")
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise ValueError(f"evidence {ref!r}: {'.'.join(parts[:i])} has no attribute path "
                                 f"{'.'.join(parts[i:])}")
            obj = getattr(obj, attr)
        return
    raise ValueError(f"evidence {ref!r}: no such module")
