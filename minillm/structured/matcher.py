"""One sequence's place in its token index, and the engine's per-engine structured-output manager: compiles each
request's language once (LRU), hands out matchers, and masks the constrained rows of a batch in one operation."""
from __future__ import annotations

from typing import Sequence

import torch

from minillm import interfaces
from minillm.structured.automata import DEAD, compile_regex
from minillm.structured.params import StructuredOutputsParams
from minillm.structured.token_index import TokenIndex, build_token_index, regex_token_index


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
    TokenIndexBuilder seam), from the LRU cache regex_token_index keeps for every engine."""
    compile_fn: interfaces.RegexCompiler = staticmethod(compile_regex)
    index_fn: interfaces.TokenIndexBuilder = staticmethod(build_token_index)

    def __init__(self, tokenizer, compile_fn: interfaces.RegexCompiler | None = None,
                 index_fn: interfaces.TokenIndexBuilder | None = None) -> None:
        cls = type(self)
        self.tokenizer = tokenizer
        self.compile_fn = compile_fn or cls.compile_fn
        self.index_fn = index_fn or cls.index_fn

    def index_for(self, params: StructuredOutputsParams) -> TokenIndex:
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (the automaton reads each token's bytes): build "
                             "the engine with one")
        return regex_token_index(params.to_regex(), self.tokenizer, self.compile_fn, self.index_fn)

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        return Matcher(self.index_for(params))

    @staticmethod
    def apply_masks(logits: torch.Tensor, rows: Sequence[int], items: Sequence[tuple[TokenIndex, int]]) -> None:
        """Set logits[rows[i], t] = -inf for every token t that items[i] = (index, state) does not allow: one
        masked_fill over the constrained rows only (each state's mask is built once and cached)."""
        if not rows:
            return
        V = logits.shape[-1]
        # off the CPU each state's mask is cached on the logits' device too: no host-built mask is copied per step
        dev = None if logits.device.type == "cpu" else logits.device
        allowed = torch.stack([index.mask(state, V) if dev is None else index.mask(state, V, dev)
                               for index, state in items])
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=dev)
        with torch.inference_mode():         # the model's logits are an inference tensor
            logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
