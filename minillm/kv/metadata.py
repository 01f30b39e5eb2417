"""The per-step batch description every attention backend reads, and the one place it is built.

The model runner (a step of the engine, or a draft model's), and the contiguous cache of the single-sequence paths
all describe their batch the same way: which sequence each flat token row belongs to, how much context each has
after the step, where each new token's K/V goes (slot_mapping) and which blocks hold each sequence (block_tables).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def build_metadata(query_lens: Sequence[int], seq_lens: Sequence[int], slot_mapping: Sequence[int] | torch.Tensor,
                   block_tables: Sequence[Sequence[int]], block_size: int,
                   device: str | torch.device = "cpu") -> "AttentionMetadata":
    """AttentionMetadata from plain lists: the block tables padded with block 0 to the longest (padding is never
    read: seq_lens bound every lookup)."""
    width = max((len(t) for t in block_tables), default=0)
    slots = slot_mapping if isinstance(slot_mapping, torch.Tensor) else torch.tensor(list(slot_mapping),
                                                                                     dtype=torch.int64)
    return AttentionMetadata(
        query_lens=list(query_lens), seq_lens=list(seq_lens), slot_mapping=slots.to(device=device, dtype=torch.int64),
        block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64,
                                  device=device),
        block_size=block_size)


@dataclass
class AttentionMetadata:
    """Per-step batch description, built once by the runner and shared by all layers.

    Sequences are ordered; tokens of sequence i are rows query_start[i]:query_start[i+1] of q.
    seq_lens[i] is the number of KV tokens sequence i has after this step (cached context + new tokens).
    """
    query_lens: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor          # [T] int64: flat slot (block * block_size + offset) for each new token
    block_tables: torch.Tensor          # [S, max_blocks] int64 (padded with 0)
    block_size: int
    query_start: list[int] = field(init=False)
    _memo: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        self.query_start = starts

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def memo(self, key, build: Callable):
        """A value derived from this step's batch, built by the first layer that asks and reused by the rest."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def decode_groups(self, group_size: int) -> list["DecodeGroup"]:
        """The step's decode rows (one query token each) in length-sorted groups."""
        return self.memo(("decode_groups", group_size), lambda: decode_groups(self, group_size))

    def decode_rows(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Query rows of the step's decode tokens, their block tables and context lengths (for decode kernels)."""
        def build():
            idx = [i for i, n in enumerate(self.query_lens) if n == 1]
            every = len(idx) == len(self.query_lens)       # a decode step: the tables as they are, no copy
            return ([self.query_start[i] for i in idx], self.block_tables if every else self.block_tables[idx],
                    torch.tensor([self.seq_lens[i] for i in idx], dtype=torch.int64, device=self.block_tables.device))
        return self.memo("decode_rows", build)

    def decode_row_index(self) -> torch.Tensor:
        """decode_rows()'s query rows as an int64 tensor (kernels that address q and out in place take it)."""
        return self.memo("decode_row_index", lambda: torch.tensor(
            self.decode_rows()[0], dtype=torch.int64, device=self.block_tables.device))

    def token_rows(self, max_query: int, max_len: int = 0
                   ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens of the sequences with at most max_query new tokens or at most max_len tokens in all, each a
        query row of its own that attends over its position and those before it (for a kernel that takes one query
        row per task): (those sequences' first rows, the rows [R] int64, their sequences' block tables
        [R, max_blocks], positions attended [R])."""
        def build():
            idx = [i for i, (n, s) in enumerate(zip(self.query_lens, self.seq_lens)) if n <= max_query or s <= max_len]
            if all(self.query_lens[i] == 1 for i in idx):
                rows, tables, lens = self.decode_rows()
                return rows, self.decode_row_index(), tables, lens
            device = self.block_tables.device
            counts = [self.query_lens[i] for i in idx]
            rows = [self.query_start[i] + j for i in idx for j in range(self.query_lens[i])]
            lens = [self.seq_lens[i] - self.query_lens[i] + j + 1 for i in idx for j in range(self.query_lens[i])]
            tables = self.block_tables[idx].repeat_interleave(torch.tensor(counts, dtype=torch.int64, device=device),
                                                              dim=0)
            return ([self.query_start[i] for i in idx], torch.tensor(rows, dtype=torch.int64, device=device), tables,
                    torch.tensor(lens, dtype=torch.int64, device=device))
        return self.memo(("token_rows", max_query, max_len), build)

    def context_slots(self, i: int) -> torch.Tensor:
        """Flat slots of positions 0..seq_lens[i]-1 of sequence i."""
        def build():
            pos = torch.arange(self.seq_lens[i], device=self.block_tables.device)
            return self.block_tables[i, pos // self.block_size] * self.block_size + pos % self.block_size
        return self.memo(("context_slots", i), build)


@dataclass
class DecodeGroup:
    """A few decode sequences of similar length, padded to the longest, attended with one gather + two matmuls."""
    seq_idx: list[int]          # which sequences of the step
    rows: torch.Tensor          # [S] int64: their query rows
    slots: torch.Tensor         # [S * Lmax] int64: context slots, padded with slot 0
    bias: torch.Tensor          # [S, Lmax] float32: 0 for real keys, -inf for padding
    max_len: int

    @staticmethod
    def build(meta: "AttentionMetadata", idx: list[int]) -> "DecodeGroup":
        dev = meta.block_tables.device
        lens = torch.tensor([meta.seq_lens[i] for i in idx], device=dev)
        L = int(lens.max())
        pos = torch.arange(L, device=dev)
        tables = meta.block_tables[idx]
        blk = torch.gather(tables, 1, (pos // meta.block_size).clamp(max=tables.shape[1] - 1).expand(len(idx), L))
        valid = pos[None, :] < lens[:, None]
        slots = torch.where(valid, blk * meta.block_size + pos % meta.block_size, 0)
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=dev).masked_fill_(~valid, float("-inf"))
        rows = torch.tensor([meta.query_start[i] for i in idx], device=dev)
        return DecodeGroup(idx, rows, slots.reshape(-1), bias, L)


# Why groups of a few sequences and not one big padded batch: on a CPU the per-sequence loop pays ~6 op
# dispatches per sequence and layer, while one batch over all sequences gathers tens of MB that fall out of
# cache before the matmul reads them back (and pads short contexts to the longest). Sorting by length and
# grouping ~4 keeps padding small and each group's K/V (a few MB) in cache.
DECODE_GROUP_SIZE = 4


def decode_groups(meta: "AttentionMetadata", group_size: int = DECODE_GROUP_SIZE) -> list[DecodeGroup]:
    idx = [i for i, n in enumerate(meta.query_lens) if n == 1 and meta.seq_lens[i] > 1]
    if group_size <= 1 or len(idx) < 2:
        return []
    idx.sort(key=lambda i: meta.seq_lens[i])
    return [DecodeGroup.build(meta, idx[a:a + group_size]) for a in range(0, len(idx), group_size)]
