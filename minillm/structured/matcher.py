"""One sequence's place in its token index, and the engine's per-engine structured-output manager: compiles each
request's language once (LRU), hands out matchers, and masks the constrained rows of a batch in one operation."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from minillm import interfaces
from minillm.structured.automata import DEAD, DFA, compile_regex, trim
from minillm.structured.params import StructuredOutputsParams
from minillm.structured.token_index import (TokenIndex, VocabTrie, build_token_index, prune_unspellable,
                                            regex_token_index, vocab_trie)


class Matcher:
    """The automaton state of one sequence: advanced by every token it appends."""

    def __init__(self, index: TokenIndex, state: int | None = None) -> None:
        self.index = index
        self.state = index.dfa.start if state is None else state

    def allows(self, token_id: int, state: int | None = None) -> bool:
        s = self.state if state is None else state
        if token_id in self.index.eos_token_ids:
            return self.index.is_accepting(s)
        return self.index.next_state(s, token_id) != DEAD

    def advance(self, token_id: int) -> None:
        """Take one appended token (EOS ends the text and leaves the state as it is)."""
        if not self.allows(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the structured-output automaton in state "
                               f"{self.state}: the sampler (or rejection sampler) ignored the mask")
        if token_id not in self.index.eos_token_ids:
            self.state = self.index.next_state(self.state, token_id)

    @property
    def is_terminated(self) -> bool:
        """The output is a full match that no token can extend: nothing is left to generate."""
        return self.index.is_terminated(self.state)

    def walk(self, token_ids: Sequence[int]) -> list[int]:
        """The state before each token of the longest allowed prefix of token_ids, and the state after it:
        len(result) - 1 tokens are allowed. The walk ends after an allowed EOS (the state stays) and at the
        first token the automaton does not allow."""
        states = [self.state]
        for t in token_ids:
            s = states[-1]
            if not self.allows(t, s):
                break
            if t in self.index.eos_token_ids:
                states.append(s)
                break
            states.append(self.index.next_state(s, t))
        return states

    def replay(self, output_token_ids: Sequence[int]) -> None:
        """Recompute the state from the start over a sequence's output (e.g. when a preempted one resumes)."""
        self.state = self.index.dfa.start
        for t in output_token_ids:
            self.advance(t)

    def copy(self) -> "Matcher":
        return Matcher(self.index, self.state)


class StructuredOutputManager:
    """Per engine: regex -> DFA (compile_fn, the RegexCompiler seam) -> token index (index_fn, the
    TokenIndexBuilder seam), cached by pattern; with minillm's own pieces the cache is shared across engines."""
    compile_fn: interfaces.RegexCompiler = staticmethod(compile_regex)
    index_fn: interfaces.TokenIndexBuilder = staticmethod(build_token_index)
    cache_size = 32

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], vocab_size: int,
                 compile_fn: interfaces.RegexCompiler | None = None,
                 index_fn: interfaces.TokenIndexBuilder | None = None) -> None:
        cls = type(self)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.compile_fn = compile_fn or cls.compile_fn
        self.index_fn = index_fn or cls.index_fn
        self._own = compile_fn is not None or index_fn is not None
        self._cache: OrderedDict[str, TokenIndex] = OrderedDict()

    def index_for(self, params: StructuredOutputsParams) -> TokenIndex:
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (the automaton reads each token's bytes): build "
                             "the engine with one")
        pattern = params.to_regex()
        if not self._own:
            return regex_token_index(pattern, self.tokenizer)
        hit = self._cache.get(pattern)
        if hit is None:
            hit = self._cache[pattern] = self._build(pattern)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(pattern)
        return hit

    def _build(self, pattern: str) -> TokenIndex:
        dfa = self.compile_fn(pattern)
        if type(dfa) is not DFA:
            raise TypeError(f"the regex compiler must return a minillm.structured.automata.DFA, got "
                            f"{type(dfa).__name__}")
        dfa = trim(dfa)                  # a learner's subset construction keeps dead states: no token may enter them
        if dfa.is_empty():
            raise ValueError(f"no text matches {pattern!r}: the pattern's language is empty")
        trie: VocabTrie = vocab_trie(self.tokenizer)
        index = self.index_fn(dfa, trie, self.eos_token_ids)
        if type(index) is not TokenIndex or len(index.allowed) != dfa.num_states:
            raise TypeError(f"the token index builder must return a TokenIndex with one allowed-token array per "
                            f"DFA state ({dfa.num_states}), got {type(index).__name__}")
        return prune_unspellable(index, pattern)

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        return Matcher(self.index_for(params))

    @staticmethod
    def apply_masks(logits: torch.Tensor, rows: Sequence[int], items: Sequence[tuple[TokenIndex, int]]) -> None:
        """Set logits[rows[i], t] = -inf for every token t that items[i] = (index, state) does not allow: one
        masked_fill over the constrained rows only (each state's mask is built once and cached)."""
        if not rows:
            return
        V = logits.shape[-1]
        allowed = torch.stack([index.mask(state, V) for index, state in items])
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        with torch.inference_mode():         # the model's logits are an inference tensor
            logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
