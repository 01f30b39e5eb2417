"""Numbers in the question bank, recomputed by the engine's own helpers.

A bank entry may carry `checks`: each names a function below, its arguments, and the `claim` — the
exact text of the figure as it appears in the answer ("2 GiB", "2.8x", "35 GB", "327,680 bytes").
`verify_check` parses the claim, calls the function and compares, so the prose and the code cannot drift.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

from minillm.kv.sizing import kv_cache_bytes, kv_tokens_that_fit, max_seqs_that_fit
from minillm.models.catalog import model_shape
from minillm.quant.memory import weight_bytes
from minillm.sampling.speculative_math import expected_speedup, expected_tokens_per_step


def _num_params(model: str) -> int:
    return model_shape(model).num_params()


def _kv_bytes_per_token(model: str, dtype_bytes: float = 2) -> float:
    return kv_cache_bytes(model, 1, dtype_bytes)


def _ratio(a: dict, b: dict, fn: str) -> float:
    """fn(**a) / fn(**b): for claims like "8x smaller"."""
    return FUNCTIONS[fn](**a) / FUNCTIONS[fn](**b)


FUNCTIONS: dict[str, Callable[..., float]] = {
    "kv_cache_bytes": kv_cache_bytes,              # (config, tokens, dtype_bytes=2)
    "kv_bytes_per_token": _kv_bytes_per_token,     # (model, dtype_bytes=2)
    "kv_tokens_that_fit": kv_tokens_that_fit,      # (config, budget_bytes, dtype_bytes=2)
    "max_seqs_that_fit": max_seqs_that_fit,        # (config, memory_bytes, weight_bytes, seq_len, dtype_bytes=2)
    "weight_bytes": weight_bytes,                  # (num_params, bits, group_size=None, scale_bits=16)
    "num_params": _num_params,                     # (model)
    "expected_tokens_per_step": expected_tokens_per_step,  # (alpha, k)
    "expected_speedup": expected_speedup,          # (alpha, k, draft_cost)
    "ratio": _ratio,                               # (a, b, fn)
}

_UNITS = {
    "": 1, "bytes": 1, "B": 1,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "K": 1e3, "M": 1e6, "B params": 1e9, "billion": 1e9,
    "x": 1, "×": 1, "%": 0.01, "tokens": 1,
}
_CLAIM = re.compile(r"^~?\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*(.*?)\s*$")


def parse_claim(claim: str) -> float:
    """'2 GiB' -> 2147483648.0, '2.8x' -> 2.8, '35 GB' -> 3.5e10, '327,680 bytes' -> 327680.0."""
    m = _CLAIM.match(claim)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read the figure {claim!r}: write a number and one of the units "
                         f"{', '.join(repr(u) for u in _UNITS if u)}")
    return float(m.group(1).replace(",", "")) * _UNITS[m.group(2)]


def verify_check(check: dict[str, Any]) -> tuple[float, float]:
    """Return (claimed, computed); raise AssertionError when they differ by more than rel_tol."""
    fn = check["fn"]
    if fn not in FUNCTIONS:
        raise KeyError(f"unknown check function {fn!r}; known: {', '.join(sorted(FUNCTIONS))}")
    computed = float(FUNCTIONS[fn](**check.get("args", {})))
    claimed = parse_claim(check["claim"])
    tol = float(check.get("rel_tol", 0.05))
    if not math.isclose(claimed, computed, rel_tol=tol):
        raise AssertionError(f"claim {check['claim']!r} = {claimed:g} but {fn}({check.get('args', {})}) = "
                             f"{computed:g} (rel_tol {tol})")
    return claimed, computed
