"""Model-based proposers: a small draft model with the target's vocabulary (draft_model), or the target's own
first layers with its final norm and LM head (layer_skip, weights shared).

The draft keeps its own paged KV pool (a KVCache and a BlockManager of its own, prefix caching off), indexed by the
target sequence's seq_id, and runs through a ModelRunner of its own (the engine's runner class: the same batch
description, the same choice of the fused CPU decode step). Each step it catches up on the tokens the target
accepted since its last proposal, then
decodes k tokens one at a time, all sequences batched. A greedy request's drafts are the draft's argmax (q
one-hot); a random request's are sampled from the draft's distribution under the request's own settings, and that
distribution is returned as q for the rejection sampler. After verification the draft forgets the KV of its
rejected guesses (its computed count rolls back to what the target kept).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from minillm import interfaces
from minillm.distributed.device import module_device
from minillm.kv.block_allocator import NoFreeBlocksError
from minillm.kv.block_manager import BlockManager
from minillm.kv.cache import KVCache
from minillm.models.llama import ForwardContext, LlamaModel
from minillm.sampling.sampler import Sampler, SamplingBatch, draw, make_generator
from minillm.spec_decode.draft import Draft
from minillm.worker.model_runner import ModelRunner, StepInputs

DRAFT_SEED_OFFSET = 0x5EED   # a seeded request's draft generator: its own stream, derived from the request's seed


class LayerSkipModel:
    """The target cut after its first `num_layers` decoder layers, then its final norm and LM head: a draft that
    costs num_layers / L of a target step and shares every weight."""

    def __init__(self, target: LlamaModel, num_layers: int) -> None:
        if not 1 <= num_layers < target.cfg.num_layers:
            raise ValueError(f"layer_skip needs 1 <= draft_layers < {target.cfg.num_layers} (the target's layers), "
                             f"got {num_layers}")
        self.target, self.num_layers = target, num_layers
        self.cfg = dataclasses.replace(target.cfg, num_layers=num_layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = self.target
        ctx.cos, ctx.sin = t.rotary.cos_sin(positions, ctx.meta.query_lens, ctx.meta.seq_lens)
        x = t.embed_tokens(input_ids)
        for layer in t.layers[:self.num_layers]:
            x = layer(x, ctx)
        return t.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


class ModelDraftProposer:
    """Drafts with a model (a LlamaModel or a LayerSkipModel) over its own paged KV pool."""

    def __init__(self, model: LlamaModel | LayerSkipModel, num_blocks: int, block_size: int,
                 backend: interfaces.AttentionBackend, sampler: Optional[Sampler] = None) -> None:
        self.model = model
        self.device = module_device(getattr(model, "target", model))     # the draft runs where its weights are
        self.kv_cache = KVCache(model.cfg, num_blocks, block_size, dtype=model.dtype, device=self.device)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv_cache, backend)
        self.sampler = sampler or Sampler()
        self.generators: dict[int, Optional[torch.Generator]] = {}

    def propose(self, seqs: list, num_tokens: Sequence[int]) -> list[Draft]:
        bm = self.block_manager
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        want = {s.seq_id: k for s, k in zip(seqs, num_tokens)}
        active = [s for s, k in zip(seqs, num_tokens) if k > 0 and self._admit(s)]
        while active:
            rows = [(s, (s.token_ids + drafts[s.seq_id])) for s in active]
            try:
                logits = self._forward(rows)
            except NoFreeBlocksError:      # the draft's pool is full: these sequences go without drafts this step
                for s in active:
                    bm.free(s.seq_id)
                break
            batch = SamplingBatch([s.params for s in active], [self._generator(s) for s in active],
                                  [s.prompt_token_ids for s, _ in rows], [t[s.num_prompt_tokens:] for s, t in rows])
            p = self.sampler.probs(logits, batch)
            tokens = p.argmax(-1)
            random_rows = [i for i, s in enumerate(active) if not s.params.greedy]
            if random_rows:
                tokens[random_rows] = draw(p[random_rows], [batch.generators[i] for i in random_rows])
            for i, s in enumerate(active):
                drafts[s.seq_id].append(int(tokens[i]))
                if not s.params.greedy:
                    probs[s.seq_id].append(p[i])
            active = [s for s in active if len(drafts[s.seq_id]) < want[s.seq_id]]
        return [Draft(drafts[s.seq_id], torch.stack(probs[s.seq_id]) if probs[s.seq_id] else None) for s in seqs]

    def _admit(self, seq) -> bool:
        if not self.block_manager.has_seq(seq.seq_id):
            self.block_manager.allocate_prompt(seq.seq_id, seq.token_ids)
        return True

    def _generator(self, seq) -> Optional[torch.Generator]:
        if seq.seq_id not in self.generators:
            seed = seq.params.seed
            self.generators[seq.seq_id] = make_generator(None if seed is None else seed + DRAFT_SEED_OFFSET + seq.index,
                                                         self.device)
        return self.generators[seq.seq_id]

    @torch.inference_mode()
    def _forward(self, rows) -> torch.Tensor:
        """One batched forward of the draft over every row's uncomputed tokens; the logits of each row's last one."""
        bm, ids, pos, slots, tables, qlens, slens, last = self.block_manager, [], [], [], [], [], [], []
        for seq, tokens in rows:                      # reserve everything first: all or nothing
            bm.append_slots(seq.seq_id, len(tokens))
        for seq, tokens in rows:
            start = bm.num_computed_tokens(seq.seq_id)
            ids += tokens[start:]
            pos += range(start, len(tokens))
            slots += bm.slot_mapping(seq.seq_id, start, len(tokens))
            tables.append(bm.block_table(seq.seq_id))
            qlens.append(len(tokens) - start)
            slens.append(len(tokens))
            last.append(len(ids) - 1)
        logits = self.runner.forward(StepInputs(torch.tensor(ids), torch.tensor(pos), qlens, slens,
                                                torch.tensor(slots, dtype=torch.int64), tables, [], last))
        for seq, tokens in rows:
            bm.commit_computed(seq.seq_id, tokens, len(tokens))
        return logits

    def verified(self, seq, num_accepted: int) -> None:
        """The target kept num_accepted drafts (now in seq.token_ids) and added one token: KV past what the
        target kept is stale."""
        bm = self.block_manager
        if bm.has_seq(seq.seq_id):
            keep = min(bm.num_computed_tokens(seq.seq_id), seq.num_tokens - 1)
            bm.commit_computed(seq.seq_id, seq.token_ids[:keep], keep)
            bm.trim(seq.seq_id, keep)

    def free(self, seq) -> None:
        self.block_manager.free(seq.seq_id)
        self.generators.pop(seq.seq_id, None)
