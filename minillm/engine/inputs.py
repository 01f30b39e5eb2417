"""A scheduled step as the model runner's StepInputs: the engine's sequences become flat token rows."""
from __future__ import annotations

import torch

from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.worker.model_runner import StepInputs


def prepare_inputs(out: SchedulerOutput) -> tuple[StepInputs, list[list[int]], list[Sequence]]:
    """The step's inputs, and for every sequence that gets logits, its rows of the logits: one row (the last
    position) for a sequence whose chunk reaches its end, k + 1 rows for one whose k speculative guesses are
    verified (the positions from its last real token on)."""
    ids, pos, qlens, slens, sample_rows, sample_seqs = [], [], [], [], [], []
    for seq, n in out.scheduled:
        start = seq.num_computed_tokens
        ids += seq.all_token_ids[start:start + n]
        pos += range(start, start + n)
        qlens.append(n)
        slens.append(start + n)
        last_real = seq.num_tokens - 1
        if start + n > last_real:     # this chunk reaches the last real token: those rows yield tokens
            first = len(ids) - n + max(0, last_real - start)
            sample_rows.append(list(range(first, len(ids))))
            sample_seqs.append(seq)
    inputs = StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), qlens, slens,
                        torch.tensor(out.slot_mapping, dtype=torch.int64), [list(t) for t in out.block_tables],
                        list(out.block_copies), [r for rs in sample_rows for r in rs])
    # the runner returns logits for inputs.sample_rows only, in order: each sequence's rows of those
    local, at = [], 0
    for rs in sample_rows:
        local.append(list(range(at, at + len(rs))))
        at += len(rs)
    return inputs, local, sample_seqs
