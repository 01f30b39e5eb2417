"""The named workloads (chat, rag, multi-turn, bursty) as columns: the same mixes as fleet.workloads (its Lengths
and constants), drawn a chunk of requests at a time with numpy, never a token id. A seed gives the same requests
every time; they are not the SimRequest generator's requests (other draws), only the same distribution.

Prefix nodes are the segment boundaries the mix knows (see columns.py): a chat request's system prompt; a RAG
prompt's instruction, then instruction + first document, + second, ...; a conversation turn's system prompt and
the previous turn's whole context (prompt + answer), which that turn left in the cache when it finished (one node
past the system prompt: a turn arriving before the previous one finished finds only the system prompt). A node's
key is a 63-bit mix of what it stands for (splitmix64).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from minillm.fleet.aggregate.columns import RequestBatch, mix
from minillm.fleet.workloads import (CHAT_ANSWER, CHAT_SYSTEM, CHAT_USER, RAG_ANSWER, RAG_DOC, RAG_DOCS,
                                     RAG_INSTRUCTION, RAG_QUESTION, RAG_ZIPF, TURN_ANSWER, TURN_MESSAGE, TURN_SYSTEM,
                                     WORKLOADS, gap_chunks)

def _times(rng: np.random.Generator, rate: float, duration: float, cv: float, chunk: int) -> Iterator[np.ndarray]:
    """Arrival times in [0, duration), a chunk at a time (the running sum of gap_chunks)."""
    t = 0.0
    for gaps in gap_chunks(rng, rate, cv, chunk):
        times = t + np.cumsum(gaps)
        t = float(times[-1])
        inside = times[times < duration]
        if len(inside):
            yield inside
        if len(inside) < len(times):
            return


def route_keys(node_key: np.ndarray, node_blocks: np.ndarray, prompt_len: np.ndarray, request_key: np.ndarray,
               block_size: int, prefix_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The prefix-aware ring key: the leading min(prefix_blocks, full blocks) blocks, named by the shallowest node
    that covers them (so requests sharing those blocks share the key), else by the request itself."""
    need = np.minimum(prefix_blocks, prompt_len // block_size)
    covers = (node_blocks >= need[:, None]) & (node_key != 0)
    first = np.argmax(covers, axis=1)
    found = covers[np.arange(len(need)), first]
    named = np.where(found, node_key[np.arange(len(need)), first], request_key)
    return mix(named, need).astype(np.uint64), need > 0


def _batch(rid0: int, times: np.ndarray, prompt: np.ndarray, out: np.ndarray, keys: np.ndarray, blocks: np.ndarray,
           seed_key: np.ndarray, block_size: int, prefix_blocks: int, finish: tuple | None = None) -> RequestBatch:
    """A batch from the drawn columns; `finish`: (keys, blocks, parent blocks) of the nodes left at the end."""
    n = len(times)
    rid = np.arange(rid0, rid0 + n, dtype=np.int64)
    keys = np.where(blocks > 0, keys, 0)
    rkey, rok = route_keys(keys, blocks, prompt, mix(seed_key, rid), block_size, prefix_blocks)
    if finish is None:
        finish = (np.zeros((n, 0), np.int64),) * 3
    return RequestBatch(rid, times, prompt.astype(np.int64), out.astype(np.int64), keys, blocks, rkey, rok, *finish)


def chat(rate: float, duration: float, seed: int = 0, cv: float = 1.0, scale: float = 1.0, block_size: int = 16,
         prefix_blocks: int = 4, num_system_prompts: int = 4, chunk: int = 8192) -> Iterator[RequestBatch]:
    """fleet.workloads.chat in columns: one node, the system prompt (Zipf-popular)."""
    rng = np.random.default_rng(seed)
    seed_key = mix(seed, 1)
    sys_len = np.maximum(1, (rng.integers(*CHAT_SYSTEM, num_system_prompts) * scale).astype(np.int64))
    sys_key = mix(seed_key, np.arange(num_system_prompts))
    weights = 1 / np.arange(1, num_system_prompts + 1)
    rid = 0
    for times in _times(rng, rate, duration, cv, chunk):
        n = len(times)
        k = rng.choice(num_system_prompts, size=n, p=weights / weights.sum())
        prompt = sys_len[k] + CHAT_USER.draw_many(rng, scale, n)
        out = CHAT_ANSWER.draw_many(rng, scale, n)
        yield _batch(rid, times, prompt, out, sys_key[k][:, None], (sys_len[k] // block_size)[:, None], seed_key,
                     block_size, prefix_blocks)
        rid += n


def _pick_distinct(rng: np.random.Generator, cdf: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows of `counts[i]` distinct indices drawn with probabilities cdf (padded with -1 to the widest): i.i.d.
    draws with repeats skipped, which is exactly sequential sampling without replacement."""
    width = int(counts.max()) if len(counts) else 0
    out = np.full((len(counts), width), -1, np.int64)
    todo = np.arange(len(counts))
    draws = 2 * width + 2
    while len(todo):
        x = np.minimum(np.searchsorted(cdf, rng.random((len(todo), draws)), side="right"), len(cdf) - 1)
        dup = (x[:, :, None] == x[:, None, :]) & np.tri(draws, k=-1, dtype=bool)[None]
        first = ~dup.any(axis=2)
        rank = np.cumsum(first, axis=1) - 1
        want = counts[todo][:, None]
        done = first.sum(axis=1) >= want[:, 0]
        rows, cols = np.nonzero(first & (rank < want) & done[:, None])
        out[todo[rows], rank[rows, cols]] = x[rows, cols]
        todo = todo[~done]
    return out


def rag(rate: float, duration: float, seed: int = 0, cv: float = 1.0, scale: float = 1.0, block_size: int = 16,
        prefix_blocks: int = 4, num_docs: int = 200, chunk: int = 8192) -> Iterator[RequestBatch]:
    """fleet.workloads.rag in columns: nodes = the instruction, then + each retrieved document in turn."""
    rng = np.random.default_rng(seed)
    seed_key = mix(seed, 2)
    instruction = max(1, int(RAG_INSTRUCTION * scale))
    doc_len = RAG_DOC.draw_many(rng, scale, num_docs)
    popularity = 1 / np.arange(1, num_docs + 1) ** RAG_ZIPF
    cdf = np.cumsum(popularity / popularity.sum())
    rid = 0
    for times in _times(rng, rate, duration, cv, chunk):
        n = len(times)
        picks = _pick_distinct(rng, cdf, rng.integers(*RAG_DOCS, n))
        lens = np.where(picks >= 0, doc_len[np.maximum(picks, 0)], 0)
        ends = instruction + np.cumsum(lens, axis=1)
        blocks = np.concatenate([np.full((n, 1), instruction // block_size), ends // block_size], axis=1)
        keys = np.empty_like(blocks)
        keys[:, 0] = mix(seed_key, 0)[0]
        for j in range(picks.shape[1]):
            keys[:, j + 1] = mix(keys[:, j], picks[:, j] + 1)
        keys[:, 1:][picks < 0] = 0
        blocks[:, 1:][picks < 0] = 0
        prompt = ends[:, -1] + RAG_QUESTION.draw_many(rng, scale, n)
        yield _batch(rid, times, prompt, RAG_ANSWER.draw_many(rng, scale, n), keys, blocks, seed_key, block_size,
                     prefix_blocks)
        rid += n


def _session_turns(rng: np.random.Generator, starts: np.ndarray, first_session: int, seed_key: np.ndarray,
                   system: int, scale: float, mean_turns: float, think_s: float, block_size: int) -> dict:
    """Every turn of the sessions starting at `starts`: arrival, prompt and answer lengths, nodes (see the module
    doc). A turn's prompt is the conversation so far: the system prompt, each earlier message and answer, its own
    message."""
    turns = rng.geometric(1 / mean_turns, len(starts))
    sess = np.repeat(np.arange(len(starts)), turns)
    head = np.r_[0, np.cumsum(turns)[:-1]]               # index of each session's first turn
    j = np.arange(len(sess)) - head[sess]                # turn number within its session
    gaps = np.where(j > 0, rng.exponential(think_s, len(sess)), 0.0)
    csum = np.cumsum(gaps)
    arrival = starts[sess] + csum - (csum[head] - gaps[head])[sess]
    msg, ans = TURN_MESSAGE.draw_many(rng, scale, len(sess)), TURN_ANSWER.draw_many(rng, scale, len(sess))
    spoken = np.cumsum(msg + ans)
    before = spoken - (msg + ans) - (spoken[head] - (msg + ans)[head])[sess]     # earlier turns' tokens
    prompt = system + before + msg
    prev = np.where(j > 0, np.arange(len(sess)) - 1, 0)
    c_key = mix(mix(seed_key, first_session + sess + 1), j + 1)
    context = (prompt + ans - 1) // block_size                 # the answer's last token is never computed
    sys_blocks = np.full(len(sess), system // block_size)
    keys = np.stack([np.full(len(sess), mix(seed_key, 0)[0]), np.where(j > 0, c_key[prev], 0)], axis=1)
    blocks = np.stack([sys_blocks, np.where(j > 0, context[prev], 0)], axis=1)
    return {"arrival": arrival, "prompt": prompt, "out": ans, "keys": keys, "blocks": blocks,
            "fkey": c_key[:, None], "fblocks": context[:, None], "fparent": sys_blocks[:, None]}


def multi_turn(rate: float, duration: float, seed: int = 0, cv: float = 1.0, scale: float = 1.0,
               block_size: int = 16, prefix_blocks: int = 4, mean_turns: float = 4.0, think_s: float = 20.0,
               chunk: int = 8192) -> Iterator[RequestBatch]:
    """fleet.workloads.multi_turn in columns: sessions start at rate / mean_turns per second; each turn comes
    think_s (exponential) after the previous one arrived; turns past `duration` are dropped. Memory: the turns of
    the sessions that started but have turns still to come."""
    rng = np.random.default_rng(seed)
    seed_key = mix(seed, 3)
    system = max(1, int(TURN_SYSTEM * scale))
    pending: dict | None = None
    rid = sessions = 0
    for starts in _times(rng, rate / mean_turns, duration, cv, max(1, int(chunk / mean_turns))):
        new = _session_turns(rng, starts, sessions, seed_key, system, scale, mean_turns, think_s, block_size)
        sessions += len(starts)
        pending = new if pending is None else {k: np.concatenate([pending[k], new[k]]) for k in new}
        ready = pending["arrival"] < starts[-1]      # no session starting later has a turn before its start
        out, pending = _split(pending, ready)
        if len(out["arrival"]):
            yield _turn_batch(rid, out, duration, seed_key, block_size, prefix_blocks)
            rid += int(np.sum(out["arrival"] < duration))
    if pending is not None and len(pending["arrival"]):
        yield _turn_batch(rid, pending, duration, seed_key, block_size, prefix_blocks)


def _split(cols: dict, mask: np.ndarray) -> tuple[dict, dict]:
    return {k: v[mask] for k, v in cols.items()}, {k: v[~mask] for k, v in cols.items()}


def _turn_batch(rid: int, cols: dict, duration: float, seed_key: np.ndarray, block_size: int,
                prefix_blocks: int) -> RequestBatch:
    order = np.argsort(cols["arrival"], kind="stable")
    order = order[cols["arrival"][order] < duration]
    c = {k: v[order] for k, v in cols.items()}
    return _batch(rid, c["arrival"], c["prompt"], c["out"], c["keys"], c["blocks"], seed_key, block_size,
                  prefix_blocks, (c["fkey"], c["fblocks"], c["fparent"]))


def batches(name: str, rate: float, duration: float, seed: int = 0, cv: float = 3.0, scale: float = 1.0,
            block_size: int = 16, prefix_blocks: int = 4) -> Iterator[RequestBatch]:
    """A workload by name (fleet.workloads.WORKLOADS) in columns; "bursty" is chat with gamma gaps of CV cv."""
    kw = {"seed": seed, "scale": scale, "block_size": block_size, "prefix_blocks": prefix_blocks}
    if name == "chat":
        return chat(rate, duration, **kw)
    if name == "bursty":
        return chat(rate, duration, cv=cv, **kw)
    if name == "rag":
        return rag(rate, duration, **kw)
    if name == "multi-turn":
        return multi_turn(rate, duration, **kw)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
