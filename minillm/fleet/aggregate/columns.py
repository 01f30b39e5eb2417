"""Requests as columns: what the aggregate simulator needs of each request, in numpy arrays, a chunk at a time.

A `RequestBatch` holds, per request, its arrival, prompt and output lengths and its *prefix nodes*: the shareable
prefixes of its prompt, shallow to deep, each as (key, full blocks it covers). A node's key stands for the whole
prefix up to it (a chained identity, like the prefix cache's chained block hash), so two requests share a node
exactly when their prompts agree up to it. The aggregate replica's prefix cache (prefix.py) keeps nodes, not
blocks: a hit is the deepest node whose whole chain is still cached.

Two ways in:
* the columnar workloads (streams.py) draw batches directly: nodes at the segment boundaries they know (a system
  prompt, a document, a conversation's earlier turns) -- millions of requests without a token id in sight;
* `from_requests` turns any SimRequest stream (a JSONL trace, a test's requests) into batches: nodes are the
  engine's own chained block hashes at a fixed grid of block counts (every block up to 16, then sparser), and the
  prefix-aware router's key is the engine router's own leading-block hash, so both simulators route alike.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields

import numpy as np

from minillm.fleet.routers import leading_block_hash
from minillm.fleet.workloads import SimRequest
from minillm.kv.prefix_cache import default_hash_fn

_MASK63 = (1 << 63) - 1
_G, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix(a, b) -> np.ndarray:
    """splitmix64 of (a, b), elementwise, as non-zero non-negative int64 keys."""
    with np.errstate(over="ignore"):
        z = np.atleast_1d(np.asarray(a).astype(np.uint64)) * _G + np.asarray(b).astype(np.uint64)
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return ((z >> np.uint64(1)) | np.uint64(1)).astype(np.int64)


@dataclass
class RequestBatch:
    """n requests in arrival order. node_key 0 = no node there; nodes are left-aligned, blocks increasing.

    `finish_*` are nodes a request leaves in the cache when it finishes (its answer's blocks: a multi-turn session's
    next prompt repeats them), each extending the node of `finish_parent` blocks (the next prompt's node before it).
    A node's blocks beyond its parent's are what it adds to the pool: every chain that holds a node holds the same
    parent before it, so holders' blocks add up. route_key is the prefix-aware ring key (route_ok False: the prompt
    is shorter than one block, and the router falls back to least outstanding tokens)."""
    request_id: np.ndarray          # int64 (n,)
    arrival: np.ndarray             # float64 (n,)
    prompt_len: np.ndarray          # int64 (n,)
    output_len: np.ndarray          # int64 (n,)
    node_key: np.ndarray            # int64 (n, K)
    node_blocks: np.ndarray         # int64 (n, K)
    route_key: np.ndarray           # uint64 (n,)
    route_ok: np.ndarray            # bool (n,)
    finish_key: np.ndarray          # int64 (n, KF)
    finish_blocks: np.ndarray       # int64 (n, KF)
    finish_parent: np.ndarray       # int64 (n, KF): blocks of the node each finish node extends

    def __len__(self) -> int:
        return len(self.arrival)

    def take(self, idx) -> "RequestBatch":
        """The rows `idx` (a slice, a mask or indices)."""
        return RequestBatch(*(getattr(self, f.name)[idx] for f in fields(self)))

    @classmethod
    def concat(cls, parts: Sequence["RequestBatch"]) -> "RequestBatch":
        """Rows of all parts; node matrices padded with zeros to the widest."""
        def col(name: str) -> np.ndarray:
            arrays = [getattr(p, name) for p in parts]
            if arrays[0].ndim == 2:
                width = max(a.shape[1] for a in arrays)
                arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays]
            return np.concatenate(arrays)
        return cls(*(col(f.name) for f in fields(cls)))


def empty_batch() -> RequestBatch:
    i, f = np.zeros(0, np.int64), np.zeros(0, np.float64)
    m = np.zeros((0, 0), np.int64)
    return RequestBatch(i, f, i, i, m, m, np.zeros(0, np.uint64), np.zeros(0, bool), m, m, m)


# ---------------------------------------------------------------------- from token ids

def grid(full_blocks: int) -> list[int]:
    """Block counts that get a node: every one up to 16, then every 4th to 256, every 16th to 1024, every 64th
    beyond. One grid for every request (a prefix of one fixed sequence), so a later prompt meets an earlier
    request's nodes at the same counts; a hit is rounded down to the grid (by under 1/16 of it past 16 blocks)."""
    marks, b = [], 0
    while True:
        b += 1 if b < 16 else 4 if b < 256 else 16 if b < 1024 else 64
        if b > full_blocks:
            return marks
        marks.append(b)


def chain_keys(tokens: Sequence[int], block_size: int, marks: Sequence[int], start: int = 0,
               parent: int | None = None) -> tuple[list[int], int | None]:
    """The engine's chained block hash at each block count in `marks` (blocks `start`.. onward from `parent`), as
    non-zero 63-bit keys; also the chain hash after the last mark (to continue the chain)."""
    keys, h, b = [], parent, start
    for m in marks:
        while b < m:
            h = default_hash_fn(h, tokens[b * block_size:(b + 1) * block_size])
            b += 1
        keys.append((h & _MASK63) | 1)
    return keys, h


def _row(req: SimRequest, block_size: int, prefix_blocks: int) -> tuple:
    prompt = req.prompt
    marks = grid(len(prompt) // block_size)
    keys, h = chain_keys(prompt, block_size, marks)
    fkeys: list[int] = []
    fmarks: list[int] = []
    if req.output_ids is not None:      # its answer's blocks stay cached: the next turn's prompt repeats them
        context = list(prompt) + list(req.output_ids[:-1])       # the last token is sampled, never computed
        fmarks = [m for m in grid(len(context) // block_size) if m > (marks[-1] if marks else 0)]
        fkeys, _ = chain_keys(context, block_size, fmarks, marks[-1] if marks else 0, h)
    lead = leading_block_hash(prompt, block_size, prefix_blocks)
    parents = ([marks[-1]] if marks else [0]) + fmarks[:-1]
    return (req.request_id, req.arrival, len(prompt), req.output_len, keys, marks,
            0 if lead is None else lead & ((1 << 64) - 1), lead is not None, fkeys, fmarks, parents[:len(fmarks)])


def _matrix(rows: list[list[int]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def from_requests(requests: Iterable[SimRequest], block_size: int, prefix_blocks: int = 4,
                  chunk: int = 2048) -> Iterator[RequestBatch]:
    """SimRequests (in arrival order) as batches of `chunk`, nodes from their token ids (see the module doc)."""
    rows: list[tuple] = []
    for req in requests:
        rows.append(_row(req, block_size, prefix_blocks))
        if len(rows) == chunk:
            yield _batch(rows)
            rows = []
    if rows:
        yield _batch(rows)


def _batch(rows: list[tuple]) -> RequestBatch:
    rid, arr, plen, olen, keys, marks, rkey, rok, fkeys, fmarks, parents = zip(*rows)
    return RequestBatch(np.array(rid, np.int64), np.array(arr, np.float64), np.array(plen, np.int64),
                        np.array(olen, np.int64), _matrix(keys), _matrix(marks), np.array(rkey, np.uint64),
                        np.array(rok, bool), _matrix(fkeys), _matrix(fmarks), _matrix(parents))
