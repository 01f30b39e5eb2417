# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 10 — Constrained decoding
#
# **The question.** *"A program will parse what your model returns, so it must be valid JSON for a given schema —
# every time, not most of the time. How do inference engines guarantee that the output matches a regex or a JSON
# Schema? How is it implemented, and what does it cost per token?"*
#
# Asked for JSON, a small model like SmolLM2 answers with Markdown fences, a chatty sentence, a list where a boolean
# should be. Retrying until the output parses wastes whole generations and still promises nothing. **Constrained
# decoding** makes invalid output impossible instead: before every sampling step the engine sets the logit of each
# token that would make the text impossible to complete to −∞, so the sampler only ever sees legal continuations.
#
# "Impossible to complete" is a question about an automaton. A JSON Schema with a fixed shape is a regular
# language, so minillm turns it into a regex, the regex into a **DFA over bytes**, and the DFA into a **token index**:
# for every DFA state, which of the vocabulary's 49,152 tokens keep the text alive, and which state each one leads
# to. At run time a step costs one lookup per constrained sequence (its mask) and one transition per token it emits.
#
# ```
# JSON Schema ──► regex ──► AST ──► NFA ────────► DFA ─────────────► token index ──► a mask per step
#    (minillm: json_schema,    (Task 1:        (Task 2:          (Task 3: DFA ×
#     regex.parse)              Thompson,       subset             vocabulary)
#                               UTF-8 bytes)    construction)
# ```
#
# **What you will build.** The three middle arrows: Thompson's construction of an NFA over UTF-8 bytes, the subset
# construction that makes it deterministic, and the per-state walk of every token through the DFA. Then you plug
# them into the engine (`engine.plug(regex_compiler=..., token_index_builder=...)`) running SmolLM2.
#
# **What you will measure.** How many outputs parse and validate against the schema, with and without the
# constraint, at several temperatures and seeds; what the constraint costs once per schema (compiling, indexing)
# and at every step (the mask), next to the cost of a decode step.
#
# Answer cells say `raise NotImplementedError()` until you fill them in; the graded cell after each one (don't edit
# it) prints nothing when you are right, and the smallest counter-example with a hint when not.

# %% nbgrader="readonly"
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports minillm.kernels

import json
import re
import time

import jsonschema
import numpy as np
import torch

from minillm import SamplingParams, StructuredOutputsParams, plots
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from minillm.loading.loader import load_model
from minillm.structured.automata import DEAD, DFA, NFA, compile_regex, utf8_sequences
from minillm.structured.regex import Alt, Chars, Concat, Repeat, parse
from minillm.structured.token_index import TokenIndex, build_token_index as minillm_token_index, vocab_trie

loaded = load_model("default", "float32")
model, tok = loaded.model, loaded.tokenizer
engine_ref = LLMEngine.from_model(model, tok, kv_cache_memory="64MiB")    # minillm's own pieces
engine = LLMEngine.from_model(model, tok, kv_cache_memory="64MiB")        # yours, once you plug them in
vocab = vocab_trie(tok)          # the vocabulary as the engine hands it to a token index builder
print(f"vocabulary: {len(vocab.token_bytes)} tokens, {sum(b is None for b in vocab.token_bytes)} special; "
      f"EOS {sorted(tok.stop_token_ids)}")

# %% [markdown]
# ## One constrained request, inside the engine
#
# A schema for a small record, and a request that must follow it. `StructuredOutputsParams(json=...)` is vLLM's
# name for it; the engine compiles the schema to one regex (printed below), the regex to a DFA and the DFA to a
# token index — once per schema, then cached — and gives the request a matcher that holds its DFA state.
#
# **The picture, from the real engine.** minillm's own pieces generate one answer (greedy). For each token of the
# output, the bar shows how many tokens of the vocabulary the mask allowed at that step (log scale; the dashed line
# is the whole vocabulary), and under it the token that was sampled.

# %%
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer"},
                         "city": {"enum": ["Paris", "Tokyo", "Lima", "Cairo"]},
                         "likes_cats": {"type": "boolean"}},
          "required": ["name", "age", "city", "likes_cats"]}
PROMPT = build_prompt_ids(tok, "Invent a person. Reply with a JSON object with the keys name, age, city and "
                               "likes_cats.")
so = StructuredOutputsParams(json=SCHEMA)
PATTERN = so.to_regex()
print(f"the schema as one regex ({len(PATTERN)} characters):\n{PATTERN}\n")


def run(eng, params, observer=None):
    """Every request (one per SamplingParams, the same prompt) in one batch, run to the end; outputs in order."""
    if observer is not None:
        eng.add_step_observer(observer)
    ids = [eng.add_request(PROMPT, p) for p in params]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    if observer is not None:
        eng.remove_step_observer(observer)
    return [done[i] for i in ids]


def piece(t):
    return tok.decode([t]).replace("\n", "\\n") or "∅"


out = run(engine_ref, [SamplingParams(temperature=0, max_tokens=96, structured_outputs=so)])[0]
index = engine_ref.structured.index_for(so)              # the (cached) token index of this schema
state, allowed_counts = index.dfa.start, []
for t in out.token_ids:
    allowed_counts.append(len(index.allowed_token_ids(state)))
    if t not in index.eos_token_ids:
        state = index.next_state(state, t)
print(f"{out.text!r}\nfinish_reason={out.finish_reason!r}, stop_reason={out.stop_reason!r}; the DFA has "
      f"{index.dfa.num_states} states")

plots.mask_sizes(allowed_counts, [repr(piece(t))[1:-1] for t in out.token_ids], len(vocab.token_bytes))

# %% [markdown]
# Read the bars from left to right. Where the schema fixes the text — the braces, the keys, the quotes — the mask
# leaves one token or a handful (the vocabulary has `{"`, `":` and `",` tokens too, so the same text can be spelled
# in several ways). Inside the name string almost every token is legal: anything without a quote, backslash or
# control character. For the age only a minus sign or digits pass (SmolLM2 spells numbers one digit at a time), for
# the city only the beginnings of the four names, for `likes_cats` only the beginnings of `true` and `false`. When the text is complete and
# nothing can extend it, the request finishes with `finish_reason="stop"` and `stop_reason=None`: the pattern
# itself stopped it.
#
# The model still chooses among the legal tokens — the mask removes options, it never adds probability to one the
# model dislikes. Everything in this picture comes from the automaton you are about to build.

# %% [markdown]
# ## Task 1 — Thompson's construction over UTF-8 bytes (3 points)
#
# minillm's parser (`minillm.structured.regex.parse`) turns a pattern into an AST of four node types:
#
# | node | meaning | example |
# |---|---|---|
# | `Chars(ranges)` | one character whose code point is in one of the inclusive `(lo, hi)` ranges | `[a-c]` → `Chars(((97, 99),))`; `.` → every code point but `\n` |
# | `Concat(parts)` | the parts one after another; `parts` may be **empty** (the empty pattern, an empty alternative) | `ab` |
# | `Alt(options)` | any one of the options | `a\|bc` |
# | `Repeat(node, min, max)` | `node` from `min` to `max` times; `max` is `None` for no bound | `x*` = `Repeat(x, 0, None)`, `x{2,3}` |
#
# An **NFA** is a graph whose edges either read one byte from a range or read nothing (ε). A text matches when some
# path from the start to the end reads exactly its bytes. Thompson's construction builds one *fragment*
# `(start, end)` per node, from the fragments of its children, linked only by ε-edges:
#
# ```
# Concat(a, b):   start ─► [a] ─ε─► [b] ─► end        Alt(a, b):   start ─ε─► [a] ─ε─► end
#                                                                        └─ε─► [b] ─ε─┘
# Repeat(x, 0, None):  start ─ε─► [x] ─ε─► end, with an ε-edge from x's end back to its start, and start ─ε─► end
# Repeat(x, 2, 3):     [x] ─ε─► [x] ─ε─► [x] ─ε─► end, where the third copy can be skipped (x x x?)
# ```
#
# Each copy of a repeated node must be a **new fragment** (another call on the same child): linking one fragment
# twice would turn `x{2}` into a loop.
#
# **Bytes, not characters.** The DFA will read the bytes of the text, because tokens are byte strings: SmolLM2's
# byte-level BPE has 313 tokens that are only part of a character (`\xe4` and `\xe4\xb8`, the first bytes of 中).
# So a `Chars` node becomes edges over UTF-8 bytes: a character below U+0080 is one byte, up to U+07FF two, up to
# U+FFFF three, beyond four. A range of characters becomes a few *sequences of byte ranges*, which
# `utf8_sequences(lo, hi)` (given, from minillm) computes — run the cell below to see it: `à`–`߿` (U+00E0–U+07FF)
# is not "C3..DF then A0..BF" (that would miss U+0100, `C4 80`), it is a byte `C3` then `A0..BF`, or a byte
# `C4..DF` then `80..BF`.
#
# Write `build_nfa(node, nfa) -> (start, end)`:
#
# * `nfa` is a `minillm.structured.automata.NFA`: `nfa.state()` adds a state and returns its id,
#   `nfa.edges[s].append((byte_lo, byte_hi, t))` adds an edge `s → t` on any byte from `byte_lo` to `byte_hi`
#   (inclusive), `nfa.eps[s].append(t)` an ε-edge `s → t`. It may already hold other states (your own recursive
#   calls build into the same NFA): create new ones with `nfa.state()` and never change the existing ones.
# * Return the fragment's `(start, end)`: the byte strings that lead from `start` to `end` must be exactly the UTF-8
#   encodings of the strings `node` matches (`re.fullmatch` semantics, which the checker compares with).

# %%
print(parse(r"(?:ab|é)+\d?"))
for lo, hi in [(ord("a"), ord("c")), (0xE9, 0xE9), (0xE0, 0x7FF), (0x4E2D, 0x4E2D)]:
    seqs = utf8_sequences(lo, hi)
    print(f"U+{lo:04X}..U+{hi:04X}:", ["  ".join(f"{a:02X}" if a == b else f"{a:02X}..{b:02X}" for a, b in seq)
                                      for seq in seqs])

# %% [markdown]
# <details><summary>Hint: the four cases</summary>
#
# * `Chars`: `start, end = nfa.state(), nfa.state()`; for each `(lo, hi)` in `node.ranges` and each `seq` in
#   `utf8_sequences(lo, hi)`, a chain of edges from `start` to `end`, one per byte range of `seq`, through new
#   states in between (a one-byte character is a single edge).
# * `Concat`: one state to start; for each part, its fragment, linked from the current end by an ε-edge; the last
#   part's end is the fragment's end (with no parts, start and end are the same state).
# * `Alt`: new start and end; ε-edges from the start to every option's start and from every option's end to the end.
# * `Repeat`: `min` copies in a row, then either a loop (`max is None`) or `max − min` copies that may each be
#   skipped (a new start and end around each, with an ε-edge between them).
# </details>
#
# <details><summary>Hint: a safe habit</summary>
#
# If every fragment's `end` has no outgoing edges when you return it, you can link it anywhere later without
# changing what the fragment matches. A loop that goes back from the body's end to the body's start breaks this
# unless you wrap it: `enter ─ε─► body ─ε─► leave`, `body end ─ε─► body start`, `enter ─ε─► leave`.
# </details>

# %% nbgrader="answer"
def build_nfa(node, nfa):
    """The Thompson fragment (start, end) of a regex AST node, built into nfa over UTF-8 bytes."""
    ### BEGIN SOLUTION
    def link(a, b):
        nfa.eps[a].append(b)

    if isinstance(node, Chars):
        start, end = nfa.state(), nfa.state()
        for lo, hi in node.ranges:
            for seq in utf8_sequences(lo, hi):
                at = start
                for b_lo, b_hi in seq[:-1]:                 # the leading bytes of a multi-byte character
                    step = nfa.state()
                    nfa.edges[at].append((b_lo, b_hi, step))
                    at = step
                nfa.edges[at].append((seq[-1][0], seq[-1][1], end))
        return start, end
    if isinstance(node, Alt):
        start, end = nfa.state(), nfa.state()
        for option in node.options:
            s, e = build_nfa(option, nfa)
            link(start, s)
            link(e, end)
        return start, end
    if isinstance(node, Concat):
        start = end = nfa.state()
        for part in node.parts:
            s, e = build_nfa(part, nfa)
            link(end, s)
            end = e
        return start, end
    if isinstance(node, Repeat):
        start = end = nfa.state()
        for _ in range(node.min):                           # the copies that must be there
            s, e = build_nfa(node.node, nfa)
            link(end, s)
            end = e
        extra = [None] if node.max is None else range(node.max - node.min)
        for _ in extra:                                     # optional copies: a loop, or max - min of them
            s, e = build_nfa(node.node, nfa)
            enter, leave = nfa.state(), nfa.state()
            link(enter, s)
            link(e, leave)
            link(enter, leave)                              # skip it
            if node.max is None:
                link(e, s)                                  # again
            link(end, enter)
            end = leave
        return start, end
    raise TypeError(f"not a regex node: {node!r}")
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab10 import check_lab10_1; check_lab10_1(build_nfa)

# %% [markdown]
# Your NFA for a small pattern: how many states, and its edges (ε-edges as `ε`). The path for `é` goes through a
# state in the middle of the character.

# %%
def show_nfa(pattern):
    nfa = NFA()
    start, end = build_nfa(parse(pattern), nfa)
    print(f"{pattern!r}: {len(nfa.edges)} states, start {start}, end {end}")
    for s in range(len(nfa.edges)):
        moves = [f"{lo:02X}{'..%02X' % hi if hi != lo else ''}→{t}" for lo, hi, t in nfa.edges[s]]
        moves += [f"ε→{t}" for t in nfa.eps[s]]
        print(f"  {s:2d}: {', '.join(moves) or '—'}")


show_nfa("é|ab")

# %% [markdown]
# ## Task 2 — the subset construction (3 points)
#
# An NFA can be in several states at once (after `a`, the NFA of `a|ab` is both at the end and half-way through
# `ab`), and following ε-edges costs time at every byte. A **DFA** has one state per *set* of NFA states, computed
# once:
#
# * the **ε-closure** of a set of states is the set plus everything reachable from it through ε-edges only (any
#   number of them; ε-edges can form cycles, as in `(a*)*`);
# * the DFA's start state is the closure of `{start}`;
# * from a DFA state (a set `S`), a byte `b` leads to the closure of every target `t` of an edge `(lo, hi, t)` of
#   a state in `S` with `lo <= b <= hi` — or to `DEAD` (`-1`) when no state of `S` has such an edge;
# * a DFA state is accepting when its set contains the NFA's `accept` state.
#
# Start from the start set, and keep expanding sets you have not seen yet (a dict from `frozenset` to a state id,
# and a list of sets still to expand), until none is left.
#
# Write `epsilon_closure(nfa, states) -> frozenset` and `determinize(nfa, start, accept) -> DFA`, returning
# `DFA(transitions, accepting, start)` (`minillm.structured.automata.DFA`):
#
# * `transitions`: a numpy `int32` array `[num_states, 256]`, the next state for every byte, or `DEAD` (−1);
# * `accepting`: a numpy `bool` array `[num_states]`;
# * `start`: the id of the start state (0 if you number the sets in the order you find them).
#
# Don't modify the NFA. The checker compares your DFA with the NFA exactly (it walks both together and reports the
# shortest byte string on which they disagree), on hand-made NFAs with ε-cycles and on Thompson NFAs of random
# patterns. An explicit dead state (a non-accepting state every byte of which leads back to itself, used in place
# of `DEAD`) is fine too: it accepts the same language, and the engine trims states that cannot reach an accepting
# one before it indexes the vocabulary.
#
# <details><summary>Hint: the 256 bytes</summary>
#
# Testing every edge for each of the 256 bytes works, but it is quicker to go the other way round: for each state
# of the set and each of its edges `(lo, hi, t)`, add `t` to the targets of the bytes `lo … hi`. Many bytes then
# share the same target set: compute each distinct set's closure once (a small dict per DFA state).
# </details>

# %% nbgrader="answer"
def epsilon_closure(nfa, states):
    """The states reachable from `states` through epsilon edges only (the states themselves included)."""
    ### BEGIN SOLUTION
    seen, todo = set(states), list(states)
    while todo:
        for t in nfa.eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)
    ### END SOLUTION


def determinize(nfa, start, accept):
    """The DFA accepting exactly what the NFA accepts from `start` to `accept` (the subset construction)."""
    ### BEGIN SOLUTION
    first = epsilon_closure(nfa, [start])
    number = {first: 0}
    subsets, rows = [first], []
    while len(rows) < len(subsets):                         # expand the sets in the order they were found
        subset = subsets[len(rows)]
        moves = [set() for _ in range(256)]
        for s in subset:
            for lo, hi, t in nfa.edges[s]:
                for b in range(lo, hi + 1):
                    moves[b].add(t)
        row, found = [DEAD] * 256, {}
        for b, targets in enumerate(moves):
            if not targets:
                continue
            key = frozenset(targets)
            if key not in found:
                nxt = epsilon_closure(nfa, key)
                if nxt not in number:
                    number[nxt] = len(subsets)
                    subsets.append(nxt)
                found[key] = number[nxt]
            row[b] = found[key]
        rows.append(row)
    accepting = np.array([accept in s for s in subsets], dtype=bool)
    return DFA(np.array(rows, dtype=np.int32), accepting, 0)
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab10 import check_lab10_2; check_lab10_2(determinize)

# %% [markdown]
# Tasks 1 and 2 together are a regex compiler — the engine's `RegexCompiler` seam, `pattern -> DFA`. Here is your
# DFA for a number, row by row (bytes that lead nowhere left out), and for a pattern with a two-byte character: the
# byte `C3` leads to a state that exists only in the middle of `é` and accepts nothing but `A9`. minillm's own
# compiler also *minimizes* the DFA (merging states that behave the same); the language is the same, the table
# smaller.

# %%
def compile_mine(pattern):
    """Your regex compiler: parse, Thompson NFA, subset construction."""
    nfa = NFA()
    start, end = build_nfa(parse(pattern), nfa)
    return determinize(nfa, start, end)


def show_dfa(dfa):
    label = lambda b: chr(b) if 0x21 <= b < 0x7F else f"{b:02X}"      # noqa: E731
    for s in range(dfa.num_states):
        row, runs, b = dfa.transitions[s], [], 0
        while b < 256:
            e = b
            while e + 1 < 256 and row[e + 1] == row[b]:
                e += 1
            if row[b] != DEAD:
                runs.append(f"{label(b)}{'..' + label(e) if e > b else ''}→{row[b]}")
            b = e + 1
        tags = (" start" if s == dfa.start else "") + (" accepting" if dfa.accepting[s] else "")
        print(f"  {s}{tags}: {', '.join(runs) or '—'}")


for pattern in [r"-?\d+(?:\.\d+)?", r"(?:é|e)+"]:
    mine = compile_mine(pattern)
    print(f"{pattern!r}: your DFA has {mine.num_states} states, minillm's minimized one "
          f"{compile_regex(pattern).num_states}")
    show_dfa(mine)
texts = ["-3.25", "3.", "007", "-", "1e5", "élée", "ee", "e\u0301"]
print("\nsame verdict as re.fullmatch:", all(compile_mine(p).matches(x) == bool(re.fullmatch(p, x, re.ASCII))
                                            for p in [r"-?\d+(?:\.\d+)?", r"(?:é|e)+"] for x in texts))

# %% [markdown]
# ## Task 3 — the token index: the DFA × the vocabulary (3 points)
#
# The sampler picks tokens, not bytes, and a token is several bytes: `Paris`, `":`, `","` (which closes one string,
# adds a comma and opens the next), `\xe4\xb8` (two thirds of 中). A token is allowed in state `s` when **all** its
# bytes can be read from `s` without reaching `DEAD` — if only its first bytes fit, the model would still emit the
# rest. The state it leads to is where its last byte leaves the DFA.
#
# Write `build_token_index(dfa, vocab, eos_token_ids) -> TokenIndex` (`minillm.structured.token_index.TokenIndex`,
# the engine's `TokenIndexBuilder` seam):
#
# * `vocab.token_bytes[i]` is token `i`'s bytes, or `None` for a special token (`<|im_end|>`, ...). Special tokens
#   and empty ones (`b""`) are never allowed. (`vocab` is a `VocabTrie`: it also stores the tokens as a byte trie —
#   `parent`, `byte`, `levels` — which you may use, not must.)
# * For every state `s` in `range(dfa.num_states)`: `allowed[s]`, a numpy integer array of the allowed token ids in
#   **increasing** order (the index looks tokens up with a binary search), and `next_states[s]`, the state each one
#   leads to, in the same order.
# * `return TokenIndex(dfa, allowed, next_states, tuple(eos_token_ids), len(vocab.token_bytes))`. Leave EOS out of
#   `allowed`: the index allows the EOS ids exactly in accepting states, where the text so far is a full match
#   (`index.allowed_token_ids(s)` adds them there).
#
# Walk the bytes yourself through `dfa.transitions` (not `dfa.step`, which is minillm's walk). Mind the cost: the
# plug-in below indexes a DFA of about 500 states against 49,152 tokens. A plain Python loop over tokens and bytes
# takes 0.1–0.2 s per state — a minute or more here. Move all the tokens one byte at a time with numpy instead.
#
# <details><summary>Hint: all the tokens at once</summary>
#
# Put the tokens' bytes in a 2-D array, one row per token, padded (say with 0) to the longest token; keep their
# lengths. From a state `s`: `at = np.full(n_tokens, s)`, then for each byte position `d`, for the tokens longer than
# `d`, `at = transitions[at, bytes[:, d]]`. Sort the tokens by length first (longest first), and "the tokens longer
# than `d`" is just the first `k_d` rows. At the end, the allowed tokens are those with `at != DEAD`.
# </details>
#
# <details><summary>Hint: DEAD is −1, and numpy loves −1</summary>
#
# Once a token's walk is `DEAD`, `transitions[-1, b]` does not fail: numpy reads row −1 as the **last** state's row,
# and the dead walk comes back to life. Stack an extra row of `DEAD`s under the table
# (`np.vstack([dfa.transitions, np.full((1, 256), DEAD)])`): index −1 then hits that row, and `DEAD` stays `DEAD`.
# </details>

# %% nbgrader="answer"
def build_token_index(dfa, vocab, eos_token_ids):
    """Per DFA state: the sorted ids of the tokens whose whole byte string keeps the DFA alive, and where each leads."""
    ### BEGIN SOLUTION
    spellings = vocab.token_bytes
    ids = np.array([t for t, data in enumerate(spellings) if data], dtype=np.int64)    # no special, no empty token
    lengths = np.array([len(spellings[t]) for t in ids], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")             # longest first: the tokens still walking are a prefix
    width = int(lengths.max()) if len(ids) else 0
    grid = np.zeros((len(ids), width), dtype=np.int64)
    for row, t in enumerate(ids[order]):
        grid[row, :len(spellings[t])] = np.frombuffer(spellings[t], dtype=np.uint8)
    walking = [int((lengths > d).sum()) for d in range(width)]
    table = np.vstack([dfa.transitions, np.full((1, 256), DEAD, dtype=np.int32)])     # row -1: DEAD stays DEAD
    allowed, next_states = [], []
    for s in range(dfa.num_states):
        at = np.full(len(ids), s, dtype=np.int64)
        for d, n in enumerate(walking):
            at[:n] = table[at[:n], grid[:n, d]]
        after = np.empty_like(at)
        after[order] = at                                   # back to increasing token ids
        ok = after != DEAD
        allowed.append(ids[ok])
        next_states.append(after[ok])
    return TokenIndex(dfa, allowed, next_states, tuple(eos_token_ids), len(spellings))
    ### END SOLUTION


# %% nbgrader="graded" points=3
from minillm.grading.lab10 import check_lab10_3; check_lab10_3(build_token_index)

# %% [markdown]
# Your index on SmolLM2's vocabulary for a pattern with accents and Chinese: at the start, the allowed tokens include
# `\xe4` and `\xe4\xb8` — a byte or two of 中, not characters at all — and `ca`, `na`, which start two of the words.
# After `\xe4\xb8` only tokens that finish the character fit.

# %%
t0 = time.perf_counter()
demo = build_token_index(compile_mine("(?:café|naïve|中文)+"), vocab, sorted(tok.stop_token_ids))
print(f"{demo.dfa.num_states} states indexed in {time.perf_counter() - t0:.2f} s")
s = demo.dfa.start
spell = lambda ids: [vocab.token_bytes[int(t)] for t in ids]          # noqa: E731
print("allowed at the start:", spell(demo.allowed_token_ids(s)))
half = next(int(t) for t in demo.allowed[s] if vocab.token_bytes[t] == "中".encode()[:2])
print("after", vocab.token_bytes[half], ":", spell(demo.allowed_token_ids(demo.next_state(s, half))))

# %% [markdown]
# ## Plug in: your automaton inside the engine
#
# `engine.plug(regex_compiler=..., token_index_builder=...)` swaps your two functions into the engine's
# structured-output manager: every constrained request's schema now goes through your compiler and your index
# (the engine then drops states from which no token sequence can reach a full match, so a masked row is never
# all −∞). Nine requests — one greedy, four seeds at temperature 0.8 and four at 1.2 — run in one continuous
# batch, with the schema and without it. Every constrained output must parse with `json.loads` and validate with
# `jsonschema`; and since your automaton accepts the same language as minillm's, the same seeds must give the same
# tokens as minillm's own pieces.

# %%
engine.plug(regex_compiler=compile_mine, token_index_builder=build_token_index)
SETTINGS = [(0.0, 0)] + [(temperature, seed) for temperature in (0.8, 1.2) for seed in range(4)]
MAX_TOKENS = 96


def params(structured):
    return [SamplingParams(temperature=t, seed=s, max_tokens=MAX_TOKENS,
                           structured_outputs=StructuredOutputsParams(json=SCHEMA) if structured else None)
            for t, s in SETTINGS]


def verdict(text):
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "does not parse"
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError as e:
        return f"parses, invalid: {e.message[:40]}"
    return "valid"


step_log = {}


def logger(name):
    step_log[name] = []
    def observe(info):          # (sequences in the step, tokens fed, seconds, the constrained rows' states after it)
        sched = info.scheduler_output
        step_log[name].append((len(sched.scheduled), sched.num_batched_tokens, info.seconds,
                               [(seq.matcher.index, seq.matcher.state) for seq, _ in sched.scheduled
                                if seq.matcher is not None]))
    return observe


t0 = time.perf_counter()
yours = run(engine, params(True), logger("constrained"))
plugged_seconds = time.perf_counter() - t0
free = run(engine, params(False), logger("unconstrained"))
ref = run(engine_ref, params(True))
print(f"{'T':>3s} {'seed':>4s}  with the schema (your pieces)")
for (t, s), a in zip(SETTINGS, yours):
    print(f"{t:3.1f} {s:4d}  {verdict(a.text):5s}  {a.text}")
print(f"\n{'T':>3s} {'seed':>4s}  without the schema")
for (t, s), b in zip(SETTINGS, free):
    print(f"{t:3.1f} {s:4d}  {verdict(b.text):14s}  {b.text[:70]!r}")
print(f"\nwith the schema: {sum(verdict(a.text) == 'valid' for a in yours)}/{len(yours)} valid, all finished by the "
      f"pattern: {all(a.finish_reason == 'stop' and a.stop_reason is None for a in yours)}; without: "
      f"{sum(verdict(b.text) == 'valid' for b in free)}/{len(free)} valid")
print(f"same tokens as minillm's own pieces: {all(a.token_ids == r.token_ids for a, r in zip(yours, ref))}")

# %% [markdown]
# Without the schema SmolLM2 does what small chat models do: it wraps the JSON in a Markdown fence, keeps talking
# after it, invents a list for `likes_cats`, picks a city outside the list — when it writes JSON at all. With the
# schema every output parses and validates, at every temperature: the sampler never saw an illegal token. The
# content is still the model's (its names and ages), and at higher temperatures it gets stranger — constrained
# decoding guarantees the syntax, not that the values make sense.

# %% [markdown]
# ## Measurement: what the constraint costs
#
# Two kinds of cost:
#
# * **once per schema**: compiling the regex to a DFA and indexing the DFA against the vocabulary. The engine
#   caches the index per pattern (an LRU), so a service pays this for each *new* schema — we time your pieces and
#   minillm's (which minimizes the DFA and walks a byte trie, level by level, instead of every token);
# * **at every step**: for the constrained rows of the batch, the mask — a boolean row per DFA state (built the
#   first time a state is visited, then cached) and one `masked_fill` over the batch's constrained rows — plus one
#   binary search per emitted token to advance the matcher.
#
# From the runs above we take the step times (a step observer's `info.seconds`) and the DFA states the
# constrained rows were in, and time the engine's masking (`engine.structured.apply_masks`) on logits of the same
# shape, for those same states. **Expected shape:** compiling takes well under a decode step; minillm's index costs
# a few decode steps and yours several times more (its DFA is not minimized, and it walks every token from every
# state), paid once per schema; the mask costs about a millisecond per step for nine rows, around 1% of a decode
# step of this model on this CPU; constrained and unconstrained decode steps take the same time, within the noise
# of this shared machine (a few percent either way: run the cell again to see it move).

# %%
def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


eos = sorted(tok.stop_token_ids)
once = {}
once["compile: yours"], dfa_mine = timed(lambda: compile_mine(PATTERN))
once["compile: minillm"], dfa_ref = timed(lambda: compile_regex(PATTERN))
once["index: yours"], _ = timed(lambda: build_token_index(dfa_mine, vocab, eos))
once["index: minillm"], _ = timed(lambda: minillm_token_index(dfa_ref, vocab, eos))
print(f"DFA states: yours {dfa_mine.num_states}, minillm's (minimized) {dfa_ref.num_states}")

decode = {name: [(n, sec, items) for n, fed, sec, items in log if fed == n]          # decode steps: 1 token each
          for name, log in step_log.items()}
step_ms = {name: 1000 * float(np.median([sec for n, sec, _ in steps if n == len(SETTINGS)]))
           for name, steps in decode.items()}
V = model.cfg.vocab_size
warm, cold = [], []
for _, _, items in decode["constrained"][:-1]:             # the states each step left behind: the next step's masks
    if not items:
        continue
    logits = torch.randn(len(items), V)
    rows = list(range(len(items)))
    warm.append(timed(lambda: engine.structured.apply_masks(logits, rows, items), repeat=3)[0])
    fresh = [(TokenIndex(ix.dfa, ix.allowed, ix.next_states, ix.eos_token_ids, ix.vocab_size), st)
             for ix, st in items]                          # new TokenIndex objects: no mask cached yet
    cold.append(timed(lambda: engine.structured.apply_masks(logits, rows, fresh))[0])
per_step = {"decode step, unconstrained": step_ms["unconstrained"] / 1000,
            "decode step, constrained": step_ms["constrained"] / 1000,
            "mask (cached rows)": float(np.median(warm)), "mask (rows built)": float(np.median(cold))}
print(f"\nper decode step, batch of {len(SETTINGS)}:")
for name, sec in per_step.items():
    print(f"  {name:28s} {1000 * sec:8.2f} ms   {100 * sec / per_step['decode step, unconstrained']:6.2f}% of a step")
print("once per schema:")
for name, sec in once.items():
    print(f"  {name:28s} {1000 * sec:8.1f} ms   = {sec / per_step['decode step, unconstrained']:5.1f} decode steps")

plots.mask_costs(per_step, once, batch=len(SETTINGS), constrained=len(SETTINGS))

# %% [markdown]
# **Reading the numbers.** The mask is cheap because all the work was done ahead of time: for each state the
# allowed tokens are a precomputed array, and the mask is a cached boolean row; a step only stacks the rows of its
# constrained sequences and fills −∞ where they are False. The decode step of a 135M model on two CPU cores is
# slow, so the ratio here is flattering; on a GPU a step of a large model takes 10–30 ms and the mask is built on
# the CPU, so engines overlap it with the forward pass and keep it as a bitmask (128,256 tokens of Llama 3 are a
# 16 KB bitmask per sequence). The real costs are elsewhere: the index for a *new* schema (seconds for big ones
# — which is why engines cache it, and why minillm minimizes the DFA and walks a trie), and the quality question
# — the model is forced down paths it would not have chosen.

# %% [markdown]
# ## Interview questions
#
# <details><summary><b>What is constrained (structured) decoding, how is it implemented, and what does it cost?</b></summary>
#
# It makes invalid output impossible instead of unlikely: before each sampling step the engine sets the logits of
# every token that would break the format to −∞, so the sampler only sees legal continuations. For a regular
# language (a regex, a JSON Schema of fixed shape) the constraint compiles to a DFA over bytes — regex → Thompson
# NFA → subset construction (→ minimization), as in Tasks 1–2 — and then to a token index: for every DFA state, the
# tokens whose whole byte string keeps the DFA alive and the state each leads to (Task 3), with EOS allowed only in
# accepting states. At run time a constrained sequence costs a mask lookup per step and a transition per token.
# Arbitrarily nested JSON or general grammars need a pushdown automaton; engines such as XGrammar or llguidance
# precompute the tokens that do not depend on the stack and check the rest at run time. Costs: compiling and
# indexing a new schema (milliseconds to seconds — cache it per schema), the per-step mask (small, overlappable with
# the forward pass; the measurement above), and quality: it guarantees syntax, not correct content.
# </details>
#
# <details><summary><b>How do you handle a token that closes one JSON string and starts the next key?</b></summary>
#
# By never reasoning about tokens as grammar symbols. SmolLM2 has a single token `","` — end a string, a comma, open
# the next one — and `":`, `{"`, `},`. The index walks every byte of a token through the automaton, so a token that
# spans several symbols is allowed exactly when all of them fit, and it lands in the state after the last one.
# The same walk handles tokens that are *less* than a symbol: 313 of SmolLM2's tokens are fragments of a multi-byte
# character, which is why the automaton reads UTF-8 bytes rather than characters (a character-level walk would
# have to drop them, and then the model could never write 中 the way it learned to spell it). A subtler effect of
# the same mismatch: forcing text such as the key `"name"` may push the model into a tokenization it never saw in
# training (`"` + `name` instead of `"name`); engines that insert forced text should re-tokenize it canonically
# ("token healing").
# </details>
#
# <details><summary><b>Why can forcing a JSON format hurt quality, and how would you mitigate it?</b></summary>
#
# The mask removes the model's preferred continuations and renormalizes what is left: when the model wanted to
# think aloud, open a Markdown fence, or put fields in another order, it is forced down a path with low probability
# under its own distribution, where its next-token predictions are worse. Strict formats also leave no room for
# reasoning before the answer (a JSON-only answer to a math question skips the chain of thought), and key order
# fixed by the schema can force the model to commit to a conclusion before the evidence. Mitigations: let the model
# reason first and constrain only the final answer (a `reasoning` field first, or a free-text section before the
# JSON); order schema keys the way a person would write them; describe the schema in the prompt and show an
# example, so the constraint agrees with what the model wants; prefer models fine-tuned for tool calls / JSON;
# keep whitespace rules loose enough to match the model's habits; evaluate task accuracy with and without the
# constraint, not just parse rates.
# </details>
#
# <details><summary><b>How would you skip model steps for text the grammar fully determines?</b></summary>
#
# When the automaton leaves only one way to go on — after `"likes` in the picture at the top, only `_cats"` can
# follow — sampling is pointless. Look for it in the DFA, not in the mask: few bars there are exactly one token
# (red), because the vocabulary spells the same bytes in several ways (`"`, `":`, `": "`...) and optional spaces
# add choices. "Jump-forward" decoding appends the forced text directly: follow DFA states that have a single
# outgoing byte until a choice appears, tokenize that string, append the tokens, and run them through the model in
# the next step as a small prefill chunk, which costs about one decode step for several tokens. Care is needed at
# the boundaries: the forced text should be tokenized the way the model would (retokenize the tail around the
# junction, or back off to the last token boundary) so the model's view stays in-distribution; with speculative
# decoding or prefix caching the appended tokens are ordinary tokens like any other. SGLang's compressed FSM and
# XGrammar's jump-forward do this; minillm only ends a request early, when the pattern is complete.
# </details>

# %% [markdown]
# ### More from the question bank
#
# Every interview question this lab answers, with the project's answer, key points and the code that backs it
# (the same bank `minillm quiz --lab lab10` rehearses in a terminal, with spaced repetition):

# %%
from minillm.quiz import show
show(lab="lab10")
