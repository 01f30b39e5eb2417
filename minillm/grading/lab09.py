"""Checkers for lab09 — tensor parallelism.

Tasks (the notebook documents the same signatures; minillm's own versions are the methods of
minillm.layers.linear.MegatronRules, the engine's TensorParallelRules seam: LlamaModel(rules=), LLM(tp_rules=)):
  lab09_1  column_rows(num_units, unit_size, rank, world_size) -> range: the rows of one column-parallel part
           (num_units units of unit_size rows: query heads, KV heads, or the single columns of gate / up) that
           `rank` holds. When num_units % world_size == 0 the units split into contiguous blocks in rank order; when
           world_size % num_units == 0 (fewer KV heads than ranks) each unit sits on world_size // num_units
           consecutive ranks, the ones whose query heads read it; otherwise ValueError.
  lab09_2  row_cols(input_size, rank, world_size) -> range: the input columns of a row-parallel matrix (o_proj,
           down_proj) that `rank` holds: the contiguous block the column-parallel layer before it produced on that
           rank; ValueError when input_size does not split evenly.
  lab09_3  a rules class with column_forward(x, weight, bias, comm) -> this rank's output columns, sending nothing;
           and row_forward(x, weight, bias, comm) -> the whole output on every rank: the rank's partial product,
           exactly one comm.all_reduce, then the bias (the same full vector on every rank) once.
  lab09_4  a class with tp_bytes_per_token(hidden_size, num_layers, dtype_bytes): two all-reduces of one hidden
           vector per decoder layer; and pp_bytes_per_token(hidden_size, pp, dtype_bytes): one hidden vector per
           boundary between pp stages. Payload bytes (what a rank hands to the collective), per token.

Oracles, none of them minillm's parallel code. lab09_1: the owner of unit u is floor(u * world / units) and the
unit of rank r floor(r * units / world), stated once (column_rows_ref); and grouped-query attention computed densely
and again rank by rank from the q / k / v rows the learner's column_rows picks: every rank's query heads must find,
on that rank, the KV heads they read. lab09_2: the contiguous split (row_cols_ref) and an MLP whose up projection is
split by output rows and down projection by the learner's input columns, summed over the ranks, against the dense
MLP. lab09_3: the dense x·Wᵀ + b against what every rank returns, on real gloo communicators (rank 0 in the
checker's own thread, where the delegation tracer sees it; the others in threads), with the communicators' counts
of what each rank sent. lab09_4: the two formulas (CommBytesRef). Hand-picked cases run first, each naming the
mistake it catches; hypothesis draws the rest.
"""
from __future__ import annotations

import datetime
import math
import threading

import torch
import torch.distributed as dist
from hypothesis import example, given, strategies as st

from minillm.grading.core import (GradingError, Hint, Task, as_float, check, class_answer, diagnose, fail,
                                  function_answer, minillm_objects, run_property)
from minillm.distributed.comm import Communicator, connect

__all__ = ["check_lab09_1", "check_lab09_2", "check_lab09_3", "check_lab09_4", "TASKS", "column_rows_ref",
           "row_cols_ref", "CommBytesRef", "gqa_attention"]

# Captured now: an answer cell that patches threading or torch.distributed later changes nothing here.
_Thread = threading.Thread
_TCPStore = dist.TCPStore
_TIMEOUT = datetime.timedelta(seconds=5)     # a collective that some rank never joins fails after this long
_JOIN_S = 15.0


def _kind(x) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _raised(e: BaseException, what: str, hint: str | None = None) -> None:
    __tracebackhide__ = True
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, RuntimeError) and ("imed out" in first or "timeout" in first.lower()):
        fail(f"your {what} waited in a collective that the other ranks never joined (gloo gave up after "
             f"{_TIMEOUT.total_seconds():g} s)",
             "every rank must call the same collectives in the same order: comm.all_reduce on every rank, not on "
             "some of them.")
    fail(f"your {what} raised {type(e).__name__}{': ' + first[:200] if first else ''}", hint)


# --------------------------------------------------------------------------- oracles

def column_rows_ref(num_units: int, unit_size: int, rank: int, world_size: int) -> range:
    """Unit u belongs to rank floor(u * world / units) when the units split evenly; with fewer units than ranks,
    rank r holds unit floor(r * units / world). Any other pair of counts cannot be sharded."""
    if num_units % world_size and world_size % num_units:
        raise ValueError(f"{num_units} units neither split over nor replicate on {world_size} ranks")
    if num_units >= world_size:
        mine = [u for u in range(num_units) if u * world_size // num_units == rank]
    else:
        mine = [rank * num_units // world_size]
    return range(mine[0] * unit_size, (mine[-1] + 1) * unit_size)


def row_cols_ref(input_size: int, rank: int, world_size: int) -> range:
    """Rank r's share of the inputs: the r-th of world_size equal contiguous blocks."""
    if input_size % world_size:
        raise ValueError(f"{input_size} inputs do not split over {world_size} ranks")
    return range(rank * input_size // world_size, (rank + 1) * input_size // world_size)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k and v [T, KV, D] -> [T, H, D]: query head h attends with KV head h // (H // KV) (no causal
    mask: what is checked here is which KV head each query head reads)."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    out = []
    for h in range(heads):
        g = h // group
        weights = torch.softmax(torch.matmul(q[:, h], k[:, g].transpose(0, 1)) / math.sqrt(dim), dim=-1)
        out.append(torch.matmul(weights, v[:, g]))
    return torch.stack(out, dim=1)


class CommBytesRef:
    """Payload bytes per token: what one rank hands to its collectives (tensor parallelism) or sends to the next
    stage (pipeline parallelism) for every token of a forward pass."""

    @staticmethod
    def tp_bytes_per_token(hidden_size, num_layers, dtype_bytes):
        all_reduces = 2 * num_layers                 # attention's o_proj and the MLP's down_proj
        one_vector = hidden_size * dtype_bytes
        return all_reduces * one_vector

    @staticmethod
    def pp_bytes_per_token(hidden_size, pp, dtype_bytes):
        boundaries = pp - 1                          # stage s hands its hidden state to stage s + 1
        one_vector = hidden_size * dtype_bytes
        return boundaries * one_vector


# --------------------------------------------------------------------------- reading ranges

def _call_range(fn, args: tuple, name: str) -> range:
    """fn(*args), which must return a plain range with step 1 (a ValueError is re-raised for the caller)."""
    __tracebackhide__ = True
    call = f"{name}{args}"
    try:
        r = fn(*args)
    except (NotImplementedError, GradingError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 — the learner's code may raise anything
        _raised(e, call, "compute with integers only (// and %), and raise ValueError when the sizes cannot be "
                         "sharded.")
    if type(r) is not range:
        fail(f"{call} must be a range (e.g. range(start, stop)), got a {_kind(r)} ({r!r:.60})",
             "return range(first_row, last_row + 1): the engine slices the checkpoint with it.")
    if r.step != 1:
        fail(f"{call} returned {r!r}: a rank's rows must be one contiguous block (step 1)",
             "the layers slice the checkpoint tensor with [start:stop]: give every rank one contiguous block.")
    return r


def _call_expect_error(fn, args: tuple, name: str, why: str) -> None:
    __tracebackhide__ = True
    call = f"{name}{args}"
    try:
        r = fn(*args)
    except ValueError as e:
        check(bool(str(e).strip()), f"{call} raised a ValueError without a message",
              "say why in the message (e.g. f\"{num_units} heads cannot be split over {world_size} ranks\"): the "
              "engine shows it to whoever asked for this tensor_parallel_size.")
        return
    except (NotImplementedError, GradingError):
        raise
    except Exception as e:  # noqa: BLE001
        fail(f"{call} raised {type(e).__name__}, expected a ValueError — {why}",
             "check the sizes first and `raise ValueError(\"...why...\")` before computing anything.")
    fail(f"{call} returned {r!r}, but {why}: raise ValueError with a message that says so",
         "an uneven split would give ranks different shapes: the engine must refuse such a tensor_parallel_size.")


# --------------------------------------------------------------------------- lab09_1 column_rows

# (num_units, unit_size, world_size, what the case is about)
COLUMN_PROBES = (
    (8, 16, 2, "8 query heads of 16 rows over 2 ranks: each rank holds a contiguous block of 4 whole heads, rank 0 "
               "the first block"),
    (1536, 1, 3, "gate (or up) of SmolLM2: 1536 columns of one row each over 3 ranks, 512 each in rank order"),
    (9, 64, 3, "SmolLM2's 9 query heads of 64 rows over 3 ranks: 3 heads (192 rows) each"),
    (4, 8, 1, "with one rank, the rank holds everything"),
    (2, 8, 4, "2 KV heads over 4 ranks: fewer units than ranks, so each KV head is replicated on 4 // 2 = 2 "
              "consecutive ranks — ranks 0 and 1 hold head 0, ranks 2 and 3 head 1 (the ranks whose query heads "
              "read it)"),
    (1, 16, 4, "one KV head (multi-query attention) over 4 ranks: every rank holds it"),
    (3, 64, 6, "3 KV heads over 6 ranks: each on 2 consecutive ranks"),
)
# (num_units, unit_size, world_size)
COLUMN_ERRORS = ((9, 64, 2), (3, 8, 2), (2, 4, 3), (6, 1, 4))
# (query heads, KV heads, head_dim, world_size): every layout check_tp_size allows
GQA_PROBES = ((8, 2, 4, 2), (8, 2, 4, 4), (8, 2, 4, 8), (9, 3, 4, 3), (4, 1, 4, 4), (12, 4, 2, 2), (6, 3, 2, 6),
              (8, 8, 2, 4), (4, 2, 2, 1))

_UNITS_HINT = Hint(
    "shard by whole units (heads, or single columns): contiguous blocks of units in rank order, and when there are "
    "fewer units than ranks, each unit replicated on the ranks whose query heads read it.",
    "if num_units % world_size == 0, each rank holds num_units // world_size consecutive units; if world_size % "
    "num_units == 0, world_size // num_units consecutive ranks share one unit; a unit is unit_size rows.",
    "if num_units % world_size == 0, rank r holds units r·(num_units // world_size) up to (r+1)·(num_units // "
    "world_size); if world_size % num_units == 0, rank r holds the one unit r // (world_size // num_units). "
    "Multiply units by unit_size to get rows.")


def _column_mistake(got: range, n: int, s: int, r: int, w: int) -> str:
    if len(got) == 0:
        return (" — an empty range: with fewer units than ranks, num_units // world_size is 0; replicate whole units "
                "instead")
    if got.start % s or len(got) % s:
        return f" — not whole units: the {s} rows of a unit (a head's head_dim rows) must stay on one rank together"
    if n < w and w % n == 0 and got == range((r % n) * s, (r % n + 1) * s):
        return (f" — rank % num_units deals the units out round-robin, but query heads are split in contiguous "
                f"blocks: rank {r}'s query heads read unit {r // (w // n)} = rank // (world_size // num_units)")
    return ""


def _check_column_case(column_rows, n: int, s: int, w: int, why: str = "") -> None:
    __tracebackhide__ = True
    for r in range(w):
        args = (n, s, r, w)
        try:
            got = _call_range(column_rows, args, "column_rows")
        except ValueError as e:
            fail(f"column_rows{args} raised ValueError ({str(e)[:80]}), but {n} units "
                 + (f"split evenly over {w} ranks" if n % w == 0 else f"replicate evenly on {w} ranks")
                 + (f" — {why}" if why else ""), _UNITS_HINT)
        want = column_rows_ref(*args)
        if got != want:
            fail(f"column_rows{args} returned {got!r}, expected {want!r}" + (f" — {why}" if why else "")
                 + _column_mistake(got, n, s, r, w), _UNITS_HINT)


def _rank_rows(column_rows, n: int, d: int, r: int, w: int, what: str) -> range:
    """The learner's rows of one attention part on rank r, checked to be whole heads inside the part."""
    __tracebackhide__ = True
    args = (n, d, r, w)
    try:
        rows = _call_range(column_rows, args, "column_rows")
    except ValueError as e:
        fail(f"column_rows{args} raised ValueError ({str(e)[:80]}) for the {what} of a model with a valid "
             f"tensor-parallel size", _UNITS_HINT)
    if len(rows) == 0:
        fail(f"column_rows{args} gave rank {r} no {what} rows: its query heads would have no KV head to read"
             + _column_mistake(rows, n, d, r, w), _UNITS_HINT)
    if not (0 <= rows.start and rows.stop <= n * d) or rows.start % d or len(rows) % d:
        fail(f"column_rows{args} returned {rows!r} for the {what} ({n} heads of {d} rows, rows 0..{n * d - 1}): a "
             f"rank must hold whole heads inside the part" + _column_mistake(rows, n, d, r, w), _UNITS_HINT)
    return rows


def _check_attention(column_rows, heads: int, kv_heads: int, d: int, w: int) -> None:
    """Dense GQA attention against each rank's own heads, sharded with the learner's column_rows."""
    __tracebackhide__ = True
    g = torch.Generator().manual_seed(heads * 1000 + kv_heads * 10 + w)
    hidden, tokens = 6, 5
    x = torch.randn(tokens, hidden, generator=g)
    wq = torch.randn(heads * d, hidden, generator=g)
    wk = torch.randn(kv_heads * d, hidden, generator=g)
    wv = torch.randn(kv_heads * d, hidden, generator=g)
    dense = gqa_attention(torch.matmul(x, wq.transpose(0, 1)).reshape(tokens, heads, d),
                          torch.matmul(x, wk.transpose(0, 1)).reshape(tokens, kv_heads, d),
                          torch.matmul(x, wv.transpose(0, 1)).reshape(tokens, kv_heads, d))
    seen = [0] * heads
    for r in range(w):
        rq = _rank_rows(column_rows, heads, d, r, w, "query heads")
        rk = _rank_rows(column_rows, kv_heads, d, r, w, "KV heads")
        hq, hk = len(rq) // d, len(rk) // d
        q_heads = list(range(rq.start // d, rq.stop // d))
        kv_held = list(range(rk.start // d, rk.stop // d))
        layout = (f"{heads} query heads, {kv_heads} KV heads, {w} ranks: rank {r} holds query heads {q_heads} and KV "
                  f"heads {kv_held}")
        if hq % hk:
            fail(f"{layout} — {hq} query heads cannot share {hk} KV heads evenly on the rank",
                 _UNITS_HINT)
        for h in q_heads:
            seen[h] += 1
        local = gqa_attention(torch.matmul(x, wq[rq.start:rq.stop].transpose(0, 1)).reshape(tokens, hq, d),
                              torch.matmul(x, wk[rk.start:rk.stop].transpose(0, 1)).reshape(tokens, hk, d),
                              torch.matmul(x, wv[rk.start:rk.stop].transpose(0, 1)).reshape(tokens, hk, d))
        if not torch.allclose(local, dense[:, rq.start // d:rq.stop // d], rtol=1e-4, atol=1e-5):
            group = heads // kv_heads
            needed = sorted({h // group for h in q_heads})
            fail(f"{layout}, but its query heads read KV heads {needed} (query head h reads KV head h // "
                 f"{group}): the rank's attention output is wrong" + _column_mistake(rk, kv_heads, d, r, w),
                 "shard every KV head together with its query group: the query heads are split in contiguous "
                 "blocks, so KV head g must sit on the ranks that hold query heads g·group … (g+1)·group − 1.")
    if heads % w == 0 and seen != [1] * heads:
        twice = [h for h, c in enumerate(seen) if c != 1]
        fail(f"{heads} query heads over {w} ranks: query head {twice[0]} is held by {seen[twice[0]]} ranks; each "
             f"must be on exactly one (o_proj adds up the ranks' heads)", _UNITS_HINT)


def verify_lab09_1(column_rows) -> None:
    for n, s, w, why in COLUMN_PROBES:
        _check_column_case(column_rows, n, s, w, why)
    for n, s, w in COLUMN_ERRORS:
        for r in range(w):
            _call_expect_error(column_rows, (n, s, r, w), "column_rows",
                               f"{n} units neither split evenly over {w} ranks nor replicate evenly on them")
    for heads, kv_heads, d, w in GQA_PROBES:
        _check_attention(column_rows, heads, kv_heads, d, w)

    @given(n=st.integers(1, 16), s=st.integers(1, 8), w=st.integers(1, 8))
    @example(n=4, s=3, w=8)
    @example(n=16, s=2, w=8)
    def prop(n, s, w):
        if n % w and w % n:
            for r in range(w):
                _call_expect_error(column_rows, (n, s, r, w), "column_rows",
                                   f"{n} units neither split evenly over {w} ranks nor replicate evenly on them")
        else:
            _check_column_case(column_rows, n, s, w)

    run_property(prop, max_examples=80)


# --------------------------------------------------------------------------- lab09_2 row_cols

# (input_size, world_size, what the case is about)
ROW_PROBES = (
    (576, 3, "o_proj of SmolLM2 at TP=3: its 576 inputs are 9 heads × 64, and rank r holds the 192 columns that its "
             "own 3 query heads produced, rank 0 the first ones"),
    (1536, 2, "down_proj of SmolLM2 at TP=2: 1536 inputs, 768 per rank in rank order"),
    (8, 4, "8 inputs over 4 ranks: 2 each, in rank order"),
    (5, 1, "with one rank, the rank holds every column"),
)
ROW_ERRORS = ((10, 4), (9, 2), (3, 6))

_ROW_HINT = Hint(
    "a row-parallel layer's input arrives split: rank r holds what ITS block of the column-parallel layer before "
    "it produced (its heads, its MLP columns).",
    "so its input columns are the r-th of world_size equal contiguous blocks, in rank order; sizes that do not "
    "split evenly are a ValueError.",
    "range(rank * input_size // world_size, (rank + 1) * input_size // world_size).")


def _check_row_case(row_cols, n: int, w: int, why: str = "") -> list[range]:
    __tracebackhide__ = True
    got = []
    for r in range(w):
        args = (n, r, w)
        try:
            cols = _call_range(row_cols, args, "row_cols")
        except ValueError as e:
            fail(f"row_cols{args} raised ValueError ({str(e)[:80]}), but {n} inputs split evenly over {w} ranks",
                 _ROW_HINT)
        got.append(cols)
    _check_mlp_sum(got, n, w)
    for r, cols in enumerate(got):
        want = row_cols_ref(n, r, w)
        if cols != want:
            fail(f"row_cols{(n, r, w)} returned {cols!r}, expected {want!r}" + (f" — {why}" if why else ""),
                 _ROW_HINT)
    return got


def _check_mlp_sum(cols_per_rank: list[range], n: int, w: int) -> None:
    """An MLP with `n` intermediate columns: up projection split by output rows in rank order (each rank applies
    the activation to its own columns), down projection split by the learner's input columns. Summed over the ranks
    it must be the dense MLP."""
    __tracebackhide__ = True
    g = torch.Generator().manual_seed(n * 31 + w)
    hidden, tokens = 3, 2
    x = torch.randn(tokens, hidden, generator=g)
    up = torch.randn(n, hidden, generator=g)
    down = torch.randn(hidden, n, generator=g)
    dense = torch.matmul(torch.relu(torch.matmul(x, up.transpose(0, 1))), down.transpose(0, 1))
    total = torch.zeros(tokens, hidden)
    for r, cols in enumerate(cols_per_rank):
        mine = row_cols_ref(n, r, w)                           # the column-parallel layer's rows on rank r
        if len(cols) != len(mine) or cols.start < 0 or cols.stop > n:
            fail(f"row_cols({n}, {r}, {w}) returned {cols!r}, but rank {r}'s input is the {len(mine)} activations "
                 f"its column-parallel layer produced (of {n}): the shapes do not match", _ROW_HINT)
        act = torch.relu(torch.matmul(x, up[mine.start:mine.stop].transpose(0, 1)))
        total = total + torch.matmul(act, down[:, cols.start:cols.stop].transpose(0, 1))
    if not torch.allclose(total, dense, rtol=1e-4, atol=1e-5):
        layout = ", ".join(f"rank {r}: {c.start}..{c.stop - 1}" for r, c in enumerate(cols_per_rank))
        fail(f"an MLP with {n} intermediate columns over {w} ranks ({layout}): summed over the ranks, the down "
             f"projection's output is not the dense one — each rank must multiply the activations it holds by the "
             f"matching columns of down_proj", _ROW_HINT)


def verify_lab09_2(row_cols) -> None:
    for n, w, why in ROW_PROBES:
        _check_row_case(row_cols, n, w, why)
    for n, w in ROW_ERRORS:
        for r in range(w):
            _call_expect_error(row_cols, (n, r, w), "row_cols", f"{n} inputs do not split evenly over {w} ranks")

    @given(n=st.integers(1, 64), w=st.integers(1, 8))
    @example(n=12, w=8)
    def prop(n, w):
        if n % w:
            for r in range(w):
                _call_expect_error(row_cols, (n, r, w), "row_cols", f"{n} inputs do not split evenly over {w} ranks")
        else:
            _check_row_case(row_cols, n, w)

    run_property(prop, max_examples=60)


# --------------------------------------------------------------------------- lab09_3 the forwards

def _communicators(world: int) -> tuple[list, object]:
    """`world` connected minillm Communicators (real gloo over loopback), for ranks that run as threads, with a
    short timeout so that a collective some rank never joins fails instead of waiting for minutes."""
    store = _TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False, timeout=_TIMEOUT)
    comms: list = [None] * world
    errors: list = []

    def join(rank: int) -> None:
        try:
            comms[rank] = connect("127.0.0.1", store.port, rank, world, "gloo", f"lab09-{id(store)}",
                                  timeout=_TIMEOUT, store=store if rank == 0 else None)
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)
    threads = [_Thread(target=join, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"the checker could not connect {world} gloo ranks over loopback: {errors[0]}")
    return comms, store


# world size -> (process groups, store): made on first use and kept while they stay healthy, so that checks share
# them (making a gloo group costs a few TCP connections, and now and then torch's store takes seconds to connect).
# Every check wraps them in fresh Communicators; a group that saw an error or a stuck rank is dropped.
_GROUPS: dict = {}


def _group(world: int) -> list:
    """Fresh Communicators (zeroed counts) over the cached process groups of `world` ranks."""
    if world not in _GROUPS:
        comms, store = _communicators(world)
        _GROUPS[world] = ([c.pg for c in comms], store)
    pgs = _GROUPS[world][0]
    return [Communicator(pg, rank, world) for rank, pg in enumerate(pgs)]


def _on_every_rank(comms: list, fn, what: str) -> list:
    """fn(rank) on all ranks at once: rank 0 in this thread (the checker's tracer sees it), the others in threads.
    The results in rank order; the first error, if any, as the verdict."""
    __tracebackhide__ = True
    world = len(comms)
    results: list = [None] * world
    errors: list = [None] * world

    def work(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 — reported from the checker's thread
            errors[rank] = e
    threads = [_Thread(target=work, args=(r,), daemon=True) for r in range(1, world)]
    for t in threads:
        t.start()
    try:
        results[0] = fn(0)
    except BaseException as e:                  # the other ranks may be left waiting in a collective
        _GROUPS.pop(world, None)
        if isinstance(e, (NotImplementedError, GradingError)) or not isinstance(e, Exception):
            raise
        other = next((x for x in errors if x is not None and not isinstance(x, RuntimeError)), None)
        _raised(other or e, f"{what} on rank {errors.index(other) if other is not None else 0} of {world}",
                "x, weight and bias are torch tensors (bias may be None); comm is a minillm Communicator: "
                "comm.all_reduce(t) sums t over the ranks in place and returns it.")
    for t in threads:
        t.join(_JOIN_S)
    if any(t.is_alive() for t in threads) or any(e is not None for e in errors) \
            or len({tuple(sorted(_sent(c).items())) for c in comms}) > 1:
        _GROUPS.pop(world, None)                # not healthy any more: the next check makes a new group
    stuck = [r for r, t in enumerate(threads, 1) if t.is_alive()]
    if stuck:
        fail(f"rank {stuck[0]} of {world} never returned from your {what}: it waits in a collective that the other "
             "ranks did not call", "every rank runs the same code: call the same collectives on every rank.")
    for r, e in enumerate(errors):
        if isinstance(e, NotImplementedError):
            raise e
        if e is not None:
            _raised(e, f"{what} on rank {r} of {world}")
    return results


def _sent(comm) -> dict:
    """What a rank's Communicator counted: {kind: messages}."""
    __tracebackhide__ = True
    try:
        return {str(k): int(v) for k, v in dict(comm.stats.messages).items() if v}
    except Exception:  # noqa: BLE001 — the learner's code replaced what the communicator counts with
        fail("your code replaced comm.stats: the checker reads what the communicator counted there",
             "leave the communicator as it is; call comm.all_reduce(t).")


def _read_output(y, shape: tuple, what: str, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    __tracebackhide__ = True
    if type(y) is not torch.Tensor:
        fail(f"{what} must be a torch.Tensor, got a {_kind(y)} on rank {rank}", "return the tensor you computed.")
    if tuple(y.shape) != shape:
        fail(f"{what} returned shape {tuple(y.shape)} on rank {rank}, expected {shape} (tokens × output features "
             f"{'of this rank' if what == 'column_forward' else 'of the whole layer'})",
             "column_forward: [tokens, this rank's rows of the weight]; row_forward: [tokens, out_features] — "
             "the whole output, on every rank.")
    if y.dtype != dtype:
        fail(f"{what} returned {y.dtype} on rank {rank} for {dtype} inputs: keep the input's dtype (a layer that "
             "upcasts hands the next layer, and the all-reduce, twice the bytes)",
             "a matmul of bfloat16 tensors is bfloat16 already: no .float() / .to(float32) anywhere in the rule.")
    return y.detach().float().clone()


def _values(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Small half-integers: every product and sum below is exact in float32 (and, for the few-input bfloat16 probe,
    in bfloat16), whatever the order of the sum."""
    return (torch.randint(-6, 7, shape, generator=g).to(torch.float32) / 2).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5))


def _unchanged(before: list, after: list, what: str) -> None:
    __tracebackhide__ = True
    for r, (old, new) in enumerate(zip(before, after)):
        for name, a, b in zip(("x", "weight", "bias"), old, new):
            if a is not None and not torch.equal(a, b):
                fail(f"your {what} changed its input {name} in place on rank {r}",
                     "the engine reuses the layer's input and weights: compute into a new tensor "
                     "(comm.all_reduce works in place, so hand it the partial product, not x).")


_COLUMN_HINT = ("a column-parallel rank holds whole output rows of the weight and the whole input x: x · weightᵀ + "
                "bias is already its share of the output. Nothing to send; the row-parallel layer after it sums.")
_ROW_HINT = ("a row-parallel rank holds some input columns: x · weightᵀ is a PARTIAL sum of the output. "
             "comm.all_reduce(partial) adds the ranks' partial sums in place; then add the bias (the same full "
             "vector on every rank) once.")


def _column_case(rules, comms: list, tokens: int, in_features: int, per_rank: int, with_bias: bool,
                 seed: int, dtype: torch.dtype = torch.float32) -> None:
    """Every rank's column_forward on its rows of a dense W (contiguous blocks in rank order)."""
    __tracebackhide__ = True
    world = len(comms)
    g = torch.Generator().manual_seed(seed)
    out_features = per_rank * world
    x = _values(g, tokens, in_features, dtype=dtype)
    w = _values(g, out_features, in_features, dtype=dtype)
    b = _values(g, out_features, dtype=dtype) if with_bias else None
    shards = [(x.clone(), w[r * per_rank:(r + 1) * per_rank].clone(),
               None if b is None else b[r * per_rank:(r + 1) * per_rank].clone()) for r in range(world)]
    given_ = [tuple(None if t is None else t.clone() for t in s) for s in shards]
    for c in comms:
        c.stats.reset()
    outs = _on_every_rank(comms, lambda r: rules.column_forward(*given_[r], comms[r]), "column_forward")
    where = (f"x [{tokens}, {in_features}], a [{out_features}, {in_features}] weight split by output rows over "
             f"{world} ranks ({per_rank} each), {'with' if with_bias else 'no'} bias")
    for r, c in enumerate(comms):
        sent = _sent(c)
        if sent:
            fail(f"your column_forward communicated ({where}): rank {r} made "
                 + ", ".join(f"{n} {k}" for k, n in sent.items())
                 + ". A column-parallel layer sends nothing: its output stays split, and the row-parallel layer "
                   "after it does the layer's one all-reduce", _COLUMN_HINT)
    _unchanged(shards, given_, "column_forward")
    for r in range(world):
        xr, wr, br = shards[r]
        y = _read_output(outs[r], (tokens, per_rank), "column_forward", r, dtype)
        plain = torch.matmul(xr.float(), wr.float().transpose(0, 1))
        want = plain if br is None else plain + br.float()
        if not _close(y, want):
            why = ""
            if br is not None and _close(y, plain):
                why = " — the bias is missing (each rank adds its own slice of it)"
            fail(f"column_forward on rank {r} ({where}) is not x · weightᵀ + bias: off by up to "
                 f"{(y - want).abs().max().item():.3g}{why}", _COLUMN_HINT)


def _row_case(rules, comms: list, tokens: int, per_rank: int, out_features: int, with_bias: bool,
              seed: int, dtype: torch.dtype = torch.float32) -> None:
    """Every rank's row_forward on its input columns of a dense W (contiguous blocks in rank order): each must
    return the dense x · Wᵀ + b, after exactly one all-reduce of the [tokens, out] partial product."""
    __tracebackhide__ = True
    world = len(comms)
    g = torch.Generator().manual_seed(seed)
    in_features = per_rank * world
    x = _values(g, tokens, in_features, dtype=dtype)
    w = _values(g, out_features, in_features, dtype=dtype)
    b = _values(g, out_features, dtype=dtype) if with_bias else None
    shards = [(x[:, r * per_rank:(r + 1) * per_rank].clone(), w[:, r * per_rank:(r + 1) * per_rank].clone(),
               None if b is None else b.clone()) for r in range(world)]
    given_ = [tuple(None if t is None else t.clone() for t in s) for s in shards]
    for c in comms:
        c.stats.reset()
    outs = _on_every_rank(comms, lambda r: rules.row_forward(*given_[r], comms[r]), "row_forward")
    where = (f"x [{tokens}, {in_features}] and a [{out_features}, {in_features}] weight split by input columns over "
             f"{world} ranks ({per_rank} each), {'with' if with_bias else 'no'} bias")
    payload = tokens * out_features * torch.empty(0, dtype=dtype).element_size()
    for r, c in enumerate(comms):
        sent = _sent(c)
        reduces = sent.get("all_reduce", 0)
        others = {k: n for k, n in sent.items() if k != "all_reduce"}
        if others:
            fail(f"your row_forward used {', '.join(others)} on rank {r} ({where}). The ranks of a row-parallel "
                 "layer hold partial SUMS of the same whole output, not different parts of it: add them with one "
                 "comm.all_reduce", _ROW_HINT)
        if reduces == 0:
            fail(f"your row_forward sent nothing on rank {r} ({where}): each rank only has a partial sum of the "
                 "output, over its own input columns", _ROW_HINT)
        if reduces > 1:
            fail(f"your row_forward made {reduces} all-reduces on rank {r} ({where}): one is enough — sum the "
                 "partial product once, and add the bias after it", _ROW_HINT)
    _unchanged(shards, given_, "row_forward")
    for r, c in enumerate(comms):
        sent_bytes = int(c.stats.bytes["all_reduce"])
        if sent_bytes != payload:
            fail(f"your row_forward all-reduced {sent_bytes} bytes on rank {r} ({where}), but the partial product "
                 f"[{tokens}, {out_features}] in {str(dtype).removeprefix('torch.')} is {payload} bytes: all-reduce "
                 "x_r · weightᵀ itself, in the input's dtype",
                 _ROW_HINT)
    plain = torch.matmul(x.float(), w.float().transpose(0, 1))
    want = plain if b is None else plain + b.float()
    for r in range(world):
        y = _read_output(outs[r], (tokens, out_features), "row_forward", r, dtype)
        if _close(y, want):
            continue
        partial = torch.matmul(shards[r][0].float(), shards[r][1].float().transpose(0, 1))
        why = ""
        if b is not None and _close(y, plain + world * b):
            why = (f" — the bias was added on every rank before the all-reduce, so the sum holds it {world} times: "
                   "add it once, after the sum")
        elif _close(y, plain / world + (0 if b is None else b)) or _close(y, want / world):
            why = " — all_reduce sums; dividing by world_size averages the partial sums, which are meant to be added"
        elif b is not None and _close(y, plain):
            why = " — the bias is missing: add it (once, after the all-reduce)"
        elif _close(y, partial) or (b is not None and _close(y, partial + b)):
            why = (" — that is this rank's own partial product: the all-reduce's result was not used "
                   "(comm.all_reduce sums the tensor you give it in place, and returns it)")
        fail(f"row_forward on rank {r} ({where}) is not the dense x · Wᵀ + b: off by up to "
             f"{(y - want).abs().max().item():.3g}{why}", _ROW_HINT)


def _instantiate(cls, what: str):
    __tracebackhide__ = True
    try:
        return cls()
    except (NotImplementedError, GradingError):
        raise
    except Exception as e:  # noqa: BLE001
        _raised(e, f"{what}()", f"the checker makes one {what}() with no arguments: don't give __init__ parameters.")


# (world_size, tokens, column: in_features / row: per-rank inputs, column: per-rank outputs / row: out_features, bias)
FORWARD_PROBES = ((2, 3, 4, 3, True), (4, 1, 2, 2, True), (3, 2, 3, 4, False), (2, 4, 1, 1, True))


def verify_lab09_3(cls) -> None:
    rules = _instantiate(cls, cls.__name__)
    groups = _group
    for seed, (world, tokens, a, c, bias) in enumerate(FORWARD_PROBES):
        _column_case(rules, groups(world), tokens, a, c, bias, seed)
    for seed, (world, tokens, a, c, bias) in enumerate(FORWARD_PROBES):
        _row_case(rules, groups(world), tokens, a, c, bias, seed + 100)
    # bfloat16 in, bfloat16 out (and on the wire): a rule that upcasts to float32 doubles the all-reduce
    _column_case(rules, groups(2), 2, 2, 2, True, 7, dtype=torch.bfloat16)
    _row_case(rules, groups(2), 2, 2, 2, True, 8, dtype=torch.bfloat16)
    # float16 too, without a bias (a rule that upcasts "unsafe" float16 only, or only where there is no bias)
    _column_case(rules, groups(2), 2, 3, 2, False, 9, dtype=torch.float16)
    _row_case(rules, groups(2), 2, 2, 2, False, 10, dtype=torch.float16)

    @given(world=st.sampled_from([2, 3, 4]), tokens=st.integers(1, 5), a=st.integers(1, 4), c=st.integers(1, 5),
           bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
    def prop(world, tokens, a, c, bias, seed):
        _column_case(rules, groups(world), tokens, a, c, bias, seed)
        _row_case(rules, groups(world), tokens, a, c, bias, seed + 1)

    run_property(prop, max_examples=12, example=False)       # every message names its layout and rank


# --------------------------------------------------------------------------- lab09_4 bytes per token

# (hidden_size, num_layers, dtype_bytes, what it is)
TP_PROBES = ((576, 30, 4, "SmolLM2-135M in float32"), (8192, 80, 2, "Llama-3-70B in bf16"),
             (4096, 32, 2, "Llama-3-8B in bf16"), (12288, 96, 2, "GPT-3 175B in fp16"))
# (hidden_size, pp, dtype_bytes, what it is)
PP_PROBES = ((8192, 2, 2, "Llama-3-70B in bf16 over 2 stages"), (576, 1, 4, "one stage: nothing to send"),
             (8192, 4, 2, "4 stages"), (16384, 8, 2, "8 stages of Llama-3.1-405B"))

_TP_MISTAKES = [
    ("one all-reduce per layer? attention ends with one (after o_proj) and so does the MLP (after down_proj): two "
     "per layer", lambda h, n, b: n * h * b),
    ("that counts the weights: in tensor parallelism the weights never move; what the ranks exchange is "
     "activations, one hidden vector per token per all-reduce", lambda h, n, b: 2 * n * h * h * b),
    ("that counts the weights: in tensor parallelism the weights never move; what the ranks exchange is "
     "activations, one hidden vector per token per all-reduce", lambda h, n, b: n * h * h * b),
    ("that counts the weights: in tensor parallelism the weights never move; what the ranks exchange is "
     "activations, one hidden vector per token per all-reduce", lambda h, n, b: 4 * n * h * h * b),
    ("that is bits: dtype_bytes is already bytes per value", lambda h, n, b: 2 * n * h * b * 8),
    ("that adds the embedding's all-reduce: minillm's vocabulary-parallel embedding does make one per token, but "
     "the formula counts the decoder layers (two all-reduces each)", lambda h, n, b: (2 * n + 1) * h * b),
]
_PP_MISTAKES = [
    ("pp stages have pp - 1 boundaries between them (one stage sends nothing): the last stage hands its output to "
     "the LM head on its own GPU", lambda h, p, b: p * h * b),
    ("one activation crosses each boundary, sent once: don't count the send and the receive both, and there is "
     "no all-reduce", lambda h, p, b: 2 * (p - 1) * h * b),
    ("that is bits: dtype_bytes is already bytes per value", lambda h, p, b: (p - 1) * h * b * 8),
]


def _same(a, b) -> bool:
    return type(a) in (int, float) and math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)


def _formula_case(fn, args: tuple, name: str, ref, mistakes, probes, what: str = "") -> None:
    __tracebackhide__ = True
    call = f"{name}{args}"
    try:
        got = fn(*args)
    except (NotImplementedError, GradingError):
        raise
    except Exception as e:  # noqa: BLE001
        _raised(e, call)
    value = as_float(got, f"{call}'s result")
    want = ref(*args)
    if _same(value, want):
        return
    why = diagnose(fn, mistakes, [args] + list(probes), _same)
    fail(f"{call} = {got:,}, expected {want:,}" + (f" ({what})" if what else "") + (f" — {why}" if why else ""),
         _BYTES_HINT)


_BYTES_HINT = Hint(
    "count what crosses between GPUs for one token: in tensor parallelism the activations the ranks all-reduce "
    "(the weights never move), in pipeline parallelism the activation one stage hands to the next.",
    "TP: how many all-reduces does one decoder layer make, and how big is each? PP: how many boundaries do pp "
    "stages have? Bytes = values × dtype_bytes.",
    "tensor parallelism: every decoder layer all-reduces one [hidden_size] vector per token twice (after o_proj, "
    "after down_proj); pipeline parallelism: each stage boundary passes one [hidden_size] vector per token.")


def verify_lab09_4(cls) -> None:
    obj = _instantiate(cls, cls.__name__)
    ref = CommBytesRef()
    tp_probes = [p[:3] for p in TP_PROBES]
    pp_probes = [p[:3] for p in PP_PROBES]
    for h, n, b, what in TP_PROBES:
        _formula_case(obj.tp_bytes_per_token, (h, n, b), "tp_bytes_per_token", ref.tp_bytes_per_token,
                      _TP_MISTAKES, tp_probes, what)
    for h, p, b, what in PP_PROBES:
        _formula_case(obj.pp_bytes_per_token, (h, p, b), "pp_bytes_per_token", ref.pp_bytes_per_token,
                      _PP_MISTAKES, pp_probes, what)

    @given(h=st.integers(1, 20000), n=st.integers(1, 128), p=st.integers(1, 16), b=st.sampled_from([1, 2, 4]))
    def prop(h, n, b, p):
        _formula_case(obj.tp_bytes_per_token, (h, n, b), "tp_bytes_per_token", ref.tp_bytes_per_token,
                      _TP_MISTAKES, tp_probes)
        _formula_case(obj.pp_bytes_per_token, (h, p, b), "pp_bytes_per_token", ref.pp_bytes_per_token,
                      _PP_MISTAKES, pp_probes)

    run_property(prop, max_examples=50, example=False)       # every message shows the call


# --------------------------------------------------------------------------- the tasks

def _bench_formula() -> list:
    return minillm_objects("minillm.bench.parallel:formula_bytes_per_token")()


_FORWARDS = ("column_forward", "row_forward")
_BYTES = ("tp_bytes_per_token", "pp_bytes_per_token")

TASKS = {t.id: t for t in (
    Task("lab09_1", what="column_rows", verify=verify_lab09_1,
         engine=minillm_objects("minillm.layers.linear:MegatronRules.column_rows"),
         oracles=lambda: [column_rows_ref], form=function_answer("column_rows")),
    Task("lab09_2", what="row_cols", verify=verify_lab09_2,
         engine=minillm_objects("minillm.layers.linear:MegatronRules.row_cols"),
         oracles=lambda: [row_cols_ref], form=function_answer("row_cols")),
    Task("lab09_3", what="MyRules", kind="class", methods=_FORWARDS, verify=verify_lab09_3,
         engine=minillm_objects("minillm.layers.linear:MegatronRules"),
         form=class_answer("MyRules", _FORWARDS, own=_FORWARDS)),
    Task("lab09_4", what="CommBytes", kind="class", methods=_BYTES, verify=verify_lab09_4,
         # minillm's own formula (the bench's, a function of a config) is listed with the oracles: the answer is a
         # class, and the delegation checks take the first reference as the class an answer must not reuse.
         engine=minillm_objects(), oracles=lambda: [CommBytesRef, *_bench_formula()],
         form=class_answer("CommBytes", _BYTES, own=_BYTES)),
)}


check_lab09_1 = TASKS["lab09_1"].checker(
    "column_rows(num_units, unit_size, rank, world_size) -> range: the rows of a column-parallel part on `rank`.")
check_lab09_2 = TASKS["lab09_2"].checker(
    "row_cols(input_size, rank, world_size) -> range: the input columns of a row-parallel matrix on `rank`.")
check_lab09_3 = TASKS["lab09_3"].checker(
    "a rules class whose column_forward(x, weight, bias, comm) sends nothing and whose row_forward(x, weight, bias, "
    "comm) all-reduces the partial product once, then adds the bias.")
check_lab09_4 = TASKS["lab09_4"].checker(
    "a class with tp_bytes_per_token(hidden_size, num_layers, dtype_bytes) and pp_bytes_per_token(hidden_size, pp, "
    "dtype_bytes): payload bytes per token.")
