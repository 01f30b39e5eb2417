"""Our token index vs xgrammar's token masks (a peer, installed as a test dependency; vLLM's default structured
output backend) on the real SmolLM2 vocabulary: walking token paths from the start, every state reached must allow
exactly the same tokens, EOS included exactly at full matches. The corpus mixes hand-written regexes (multi-byte
characters, classes, bounded and unbounded repeats, optional tails after a match) and the regexes our JSON Schema
compiler emits.

(outlines-core 0.2.14 was the first peer tried: it disagrees with both us and xgrammar on optional multi-character
tails after a match -- for 0(a5)? it allows only EOS after "0", though "0a5" matches -- so it is not used.)"""
from __future__ import annotations

import re

import pytest
import torch

from minillm.structured.json_schema import json_object_regex, schema_to_regex
from minillm.structured.token_index import regex_token_index

# Peers read \d \w \s as Unicode classes (ours are ASCII, as re.ASCII): give the peer [0-9] etc.
REGEXES = [
    r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]+@[a-z]+\.(com|org)",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"héllo|中文|[α-ω]{2,4}",
    r'"[^"\\\x00-\x1f]{0,12}"',
    r"(ab|cd)*e?[^a-z\n]{1,3}",
    r"0(a5)?x?",
    r"The (quick|slow) brown [a-z]{3,5}\.",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                      "email": {"type": "string", "format": "email"},
                                      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                      "active": {"type": "boolean"}}, "required": ["name", "age"]},
    {"type": "array", "items": {"enum": ["red", "green", None, 3]}, "minItems": 1, "maxItems": 4},
    {"anyOf": [{"type": "number"}, {"type": "string", "format": "date"}]},
]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from minillm.loading.default_model import default_model_path
    from minillm.loading.gguf_file import GGUFFile
    from minillm.loading.tokenizer import Tokenizer
    return Tokenizer.from_gguf(GGUFFile.open(default_model_path()).metadata)


@pytest.fixture(scope="module")
def peer(smol_tokenizer):
    import xgrammar as xgr
    tok = smol_tokenizer
    info = xgr.TokenizerInfo([b if b is not None else b"" for b in tok.token_bytes()], vocab_type=xgr.VocabType.RAW,
                             vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.stop_token_ids))
    return xgr, info, xgr.GrammarCompiler(info)


def ascii_classes(pattern: str) -> str:
    return re.sub(r"(?<!\\)\\d", "[0-9]", pattern)


# xgrammar lets a negated class match UTF-16 surrogates encoded as bytes (ED A0..BF ..), which are not valid UTF-8;
# we follow strict UTF-8, so tokens that would spell one are the one deliberate difference.
SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def compare(pattern: str, tok, peer, max_states: int = 120) -> int:
    xgr, info, compiler = peer
    ours, grammar = regex_token_index(pattern, tok), compiler.compile_regex(ascii_classes(pattern))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    bits = torch.arange(32, dtype=torch.int32)
    tb = tok.token_bytes()

    def theirs(path: list[int]) -> set[int]:
        m = xgr.GrammarMatcher(grammar)
        for t in path:
            assert m.accept_token(t), (pattern, path)
        m.fill_next_token_bitmask(bitmask)
        return set((((bitmask[0].view(-1, 1) >> bits) & 1).flatten()[:info.vocab_size]).nonzero()[:, 0].tolist())

    seen, queue = set(), [(ours.dfa.start, [])]
    while queue and len(seen) < max_states:
        s, path = queue.pop(0)
        if s in seen:
            continue
        seen.add(s)
        mine = set(ours.allowed_token_ids(s).tolist())
        tail = b"".join(tb[t] for t in path)[-1:]
        other = {t for t in theirs(path) if tb[t] is None or not SURROGATE.search(tail + tb[t])}
        assert mine == other, (pattern, tok.decode(path), sorted(mine ^ other)[:10])
        # one token per distinct next state: a shortest token path to every state
        for nxt, tok_id in dict(zip(ours.next_states[s].tolist(), ours.allowed[s].tolist())).items():
            queue.append((nxt, path + [tok_id]))
    return len(seen)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", REGEXES + [schema_to_regex(s) for s in SCHEMAS] + [json_object_regex()],
                         ids=[f"regex{i}" for i in range(len(REGEXES))] + [f"schema{i}" for i in range(len(SCHEMAS))]
                         + ["json_object"])
def test_same_allowed_tokens_as_xgrammar(pattern, smol_tokenizer, peer):
    assert compare(pattern, smol_tokenizer, peer) >= 3
