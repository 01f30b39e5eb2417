"""Proposers by name: SpeculativeConfig.method picks one from PROPOSERS. A new proposer registers a factory here
(`@register("name")`) instead of the engine growing another branch.

    ngram        prompt lookup: find the last n tokens earlier in the prompt + output, propose what followed
    draft_model  a smaller model with the same vocabulary, over a KV pool of its own
    layer_skip   the target itself cut after its first layers (plus its final norm and LM head), weights shared
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from minillm import interfaces
from minillm.config import SpeculativeConfig
from minillm.distributed.device import module_device
from minillm.loading.loader import load_model
from minillm.models.llama import LlamaModel
from minillm.spec_decode.draft_model import LayerSkipModel, ModelDraftProposer
from minillm.spec_decode.ngram import NgramProposer


@dataclass
class ProposerContext:
    """What a proposer factory may use: the target, its tokenizer, and the pool shape and attention backend a
    model-based draft mirrors (as many tokens as the target's pool)."""
    target: LlamaModel
    tokenizer: Any
    num_blocks: int
    block_size: int
    backend: interfaces.AttentionBackend


ProposerFactory = Callable[[SpeculativeConfig, ProposerContext], interfaces.Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register(method: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def add(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[method] = factory
        return factory
    return add


def build_proposer(spec: SpeculativeConfig, ctx: ProposerContext) -> interfaces.Proposer:
    """The proposer a SpeculativeConfig names (config.METHODS lists the same names; a test keeps them in step)."""
    if spec.method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {spec.method!r}: use one of {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[spec.method](spec, ctx)


@register("ngram")
def _ngram(spec: SpeculativeConfig, ctx: ProposerContext) -> interfaces.Proposer:
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


@register("layer_skip")
def _layer_skip(spec: SpeculativeConfig, ctx: ProposerContext) -> interfaces.Proposer:
    return ModelDraftProposer(LayerSkipModel(ctx.target, spec.draft_layers), ctx.num_blocks, ctx.block_size,
                              ctx.backend)


@register("draft_model")
def _draft_model(spec: SpeculativeConfig, ctx: ProposerContext) -> interfaces.Proposer:
    loaded = load_model(spec.model, ctx.target.dtype, device=module_device(ctx.target))
    check_same_vocabulary(ctx.target.cfg.vocab_size, ctx.tokenizer, loaded.config.vocab_size, loaded.tokenizer,
                          str(loaded.path))
    return ModelDraftProposer(loaded.model, ctx.num_blocks, ctx.block_size, ctx.backend)


def check_same_vocabulary(target_vocab_size: int, target_tokenizer: Any, draft_vocab_size: int,
                          draft_tokenizer: Any, draft_name: str) -> None:
    """A draft must number tokens exactly as the target does: its guesses are token ids the target verifies."""
    hint = "pick a draft model of the target's family (same tokenizer), or use method 'ngram' or 'layer_skip'"
    if target_vocab_size != draft_vocab_size:
        raise ValueError(f"the draft model {draft_name} has a vocabulary of {draft_vocab_size} tokens, the target "
                         f"{target_vocab_size}: {hint}")
    if target_tokenizer is not None and draft_tokenizer is not None:
        a, b = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise ValueError(f"the draft model {draft_name} numbers its tokens differently from the target "
                             f"(e.g. {diff}): {hint}")
