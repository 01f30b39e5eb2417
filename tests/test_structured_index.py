"""The token index against brute force: for every DFA state, a token is allowed exactly when walking its bytes one by
one (DFA.step) stays alive, and leads to the state that walk ends in; EOS exactly in accepting states; special and
empty tokens never. Random vocabularies made of byte strings that cut UTF-8 characters anywhere, random patterns."""
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minillm.structured.automata import DEAD, compile_regex
from minillm.structured.token_index import VocabTrie, build_token_index, regex_token_index
from test_structured_regex import ALPHABET, node

EOS = 1


def random_vocab(seed: int, size: int) -> list:
    """Byte strings cut from random text at random byte offsets (so many are partial characters), a few repeats
    and prefixes of each other, and None / b"" entries (special and empty tokens)."""
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(400)).encode("utf-8")
    vocab = [None, None, b""]                       # ids 0, 1 (EOS) special; 2 empty
    while len(vocab) < size:
        i = rng.randrange(len(text))
        vocab.append(text[i:i + rng.choice([1, 1, 2, 3, 4, 6])])
    vocab += [bytes([b]) for b in rng.sample(range(256), 40)]
    return vocab


def brute_force(dfa, vocab, state):
    out = {}
    for tid, data in enumerate(vocab):
        if data:
            s = dfa.step(state, data)
            if s != DEAD:
                out[tid] = s
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(pattern=node(), seed=st.integers(0, 2**16))
def test_index_equals_walking_every_token_through_the_dfa(pattern, seed):
    vocab = random_vocab(seed, 300)
    dfa = compile_regex(pattern)
    index = build_token_index(dfa, VocabTrie.build(vocab), eos_token_ids=(EOS,))
    for s in range(dfa.num_states):
        expected = brute_force(dfa, vocab, s)
        assert dict(zip(index.allowed[s].tolist(), index.next_states[s].tolist())) == expected
        ids = set(index.allowed_token_ids(s).tolist())
        assert (EOS in ids) == bool(dfa.accepting[s])
        assert not ids & {0, 2}
        assert index.mask(s).nonzero().flatten().tolist() == sorted(ids)
        for tid in list(expected)[:5] + [0, 2, len(vocab) - 1]:
            assert index.next_state(s, tid) == expected.get(tid, DEAD)


def test_a_token_that_only_starts_the_pattern_is_allowed_one_that_overshoots_is_not():
    vocab = [None, None, b"12", b"123", b"1234", b"3-", b"-", b"\xe4\xb8", b"\xad"]
    index = build_token_index(compile_regex(r"\d{3}-?(中)?"), VocabTrie.build(vocab), eos_token_ids=(EOS,))
    start = index.dfa.start
    assert set(index.allowed_token_ids(start).tolist()) == {2, 3}       # "1234" overshoots \d{3}
    s = index.next_state(start, 2)
    assert set(index.allowed_token_ids(s).tolist()) == {5}              # "3-"
    s = index.next_state(s, 5)
    assert set(index.allowed_token_ids(s).tolist()) == {7, EOS}         # half of 中, or stop
    s = index.next_state(s, 7)
    assert set(index.allowed_token_ids(s).tolist()) == {8}              # only the rest of 中; no EOS mid-character


@pytest.mark.slow
def test_smollm2_vocabulary(smollm):
    tok = smollm.tokenizer
    tb = tok.token_bytes()
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(rng.choice(ALPHABET + ["Hello", " world", '{"a": 1}', "ünïcödé"]) for _ in range(12))
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tb[i] for i in ids) == text.encode("utf-8")
    assert all(tb[i] is None for i in tok.special_token_ids)
    pattern = r'\{"name": "[^"]{1,12}", "age": (0|[1-9]\d{0,2})\}'
    index = regex_token_index(pattern, tok)
    assert regex_token_index(pattern, tok) is index                      # cached
    states = [index.dfa.start] + rng.sample(range(index.dfa.num_states), 3)
    for s in states:
        expected = brute_force(index.dfa, tb, s)
        assert dict(zip(index.allowed[s].tolist(), index.next_states[s].tolist())) == expected
    assert np.isin(list(tok.special_token_ids - tok.stop_token_ids), index.allowed_token_ids(states[0])).sum() == 0
