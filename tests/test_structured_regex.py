"""Regex -> byte-level DFA against Python's own `re.fullmatch` (re.ASCII: \\d \\w \\s as JSON Schema reads them).

Patterns are drawn as ASTs and rendered to text, so every drawn pattern is valid for both; texts are drawn both at
random over an alphabet with 1- to 4-byte UTF-8 characters and as strings the pattern's own grammar generates (so
matches are common, not rare), then mutated."""
import re

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from minillm.structured.automata import DEAD, RegexTooComplex, compile_regex, utf8_sequences
from minillm.structured.regex import RegexError

# the edges of every class (\d \w \s, ranges) and of every UTF-8 length, plus a few ordinary characters
ALPHABET = ["a", "b", "c", "d", "0", "7", "9", "/", ":", "@", "A", "Z", "[", "_", "`", "z", "{", "-", ".", " ", "\t",
            "\n", "\x0b", "\x0c", "\r", "\x0e", "\x1f", "\x00", "\x7f", "\x80", "ß", "à", "é", "ö", "ü", "ý", "\u07ff",
            "\u0800", "中", "€", "\ufffd", "\uffff", "\U00010000", "😀", "\U0001f601", "\U0010fffd", "\U0010ffff"]
CHARS = st.one_of(st.sampled_from(ALPHABET), st.characters(blacklist_categories=("Cs",)))
ATOMS = ["a", "b", "é", "中", "😀", r"\.", "-", r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", ".", "[a-c]", "[^a-c]", "[é-ü]",
         "[^\\d\\s]", "[\u00e0-\U0001f600]", r"\u4e2d", "[-a]", "[^\U0010fffe]", "[0-9a-z]", "[\x7f-\u0800]"]


def node():
    """A random pattern: atoms joined by concatenation, alternation and every quantifier form, groups around each
    operand so the rendering is unambiguous."""
    atom = st.sampled_from(ATOMS)

    def extend(inner):
        seq = st.lists(inner, min_size=2, max_size=3).map(lambda xs: "".join(f"(?:{x})" for x in xs))
        alt = st.lists(inner, min_size=2, max_size=3).map(lambda xs: "|".join(f"(?:{x})" for x in xs))
        rep = st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,2}", "{1,}", "{,2}", "*?"])).map(
            lambda t: f"(?:{t[0]}){t[1]}")
        return st.one_of(seq, alt, rep)
    return st.recursive(atom, extend, max_leaves=6)


def reference(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=node(), texts=st.lists(st.text(alphabet=CHARS, max_size=6), min_size=1, max_size=8))
@example(pattern=r"(?:a|é)+(?:\d){2}", texts=["aé07", "é0", "a\u00e907"])
@example(pattern=r"[^a-c]*", texts=["中😀\n", "a", "", "\U0010fffd"])
@example(pattern="[^\U0010fffe]", texts=["\U0010ffff", "\U0010fffe", "\U0010fffd"])
@example(pattern=r"(?:\W)*(?:\w)?", texts=["-é 中_", "é7", "a_"])
def test_dfa_accepts_exactly_what_re_fullmatch_accepts(pattern, texts):
    dfa = compile_regex(pattern)
    for text in texts + [t[:-1] for t in texts if t]:
        assert dfa.matches(text) == reference(pattern, text), (pattern, text)


def sample_match(dfa, rng, max_len=12):
    """A random byte path from the start to an accepting state (every trimmed state can reach one)."""
    s, out = dfa.start, bytearray()
    while True:
        if dfa.accepting[s] and (len(out) >= max_len or rng.random() < 0.3):
            return bytes(out)
        bytes_ok = [b for b in range(256) if dfa.transitions[s, b] != DEAD]
        if not bytes_ok:
            return bytes(out)
        b = rng.choice(bytes_ok)
        out.append(b)
        s = int(dfa.transitions[s, b])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(pattern=node(), seed=st.integers(0, 2**16))
def test_texts_the_dfa_generates_are_valid_utf8_and_match(pattern, seed):
    """Every accepted byte string decodes as UTF-8 and re.fullmatch accepts it: the automaton never accepts
    half a character, and its trimmed states really can still complete."""
    import random
    dfa = compile_regex(pattern)
    rng = random.Random(seed)
    for _ in range(5):
        data = sample_match(dfa, rng)
        text = data.decode("utf-8")                   # raises on a broken sequence
        assert reference(pattern, text), (pattern, text)


@given(lo=st.integers(0, 0x10FFFF), span=st.integers(0, 5000))
@settings(max_examples=300, derandomize=True)
def test_utf8_sequences_cover_exactly_the_range(lo, span):
    hi = min(lo + span, 0x10FFFF)
    seqs = utf8_sequences(lo, hi)
    probes = {lo, hi, (lo + hi) // 2, max(lo - 1, 0), min(hi + 1, 0x10FFFF)}
    for cp in probes:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        enc = chr(cp).encode("utf-8")
        covered = any(len(seq) == len(enc) and all(a <= x <= b for x, (a, b) in zip(enc, seq)) for seq in seqs)
        assert covered == (lo <= cp <= hi), (hex(lo), hex(hi), hex(cp))


def test_minimal_sizes():
    assert compile_regex(r"(ab|c)*").num_states == 2
    assert compile_regex(r"\d{3}-\d{4}").num_states == 9
    assert compile_regex(r"a|a|a").num_states == 2
    assert compile_regex(r"[^\x00-\U0010ffff]").is_empty()


@pytest.mark.parametrize("pattern, needle", [
    (r"(?=a)b", "lookahead"), (r"(?<!a)b", "lookbehind"), (r"(a)\1", "backreference"), (r"(?P<x>a)(?P=x)", "backreference"),
    (r"\bword", "word boundary"), (r"(?i)abc", "not supported"), (r"a{5,2}", "smaller than the minimum"),
    (r"[z-a]", "bad range"), (r"(ab", "missing ')'"), (r"ab)", "unbalanced ')'"), (r"*a", "nothing to repeat"),
    (r"[ab", "missing ']'"), (r"a**", "multiple repeat"), (r"a{2000}", "above 1000"), (r"\q", "unknown escape"),
    (r"a^b", "'^' inside"), (r"a$b", "'$' inside"), (r"\p{L}", "Unicode property"), (r"a*+", "possessive"),
])
def test_unsupported_or_malformed_patterns_name_the_construct(pattern, needle):
    with pytest.raises(RegexError, match=re.escape(needle)):
        compile_regex(pattern)


@pytest.mark.timeout(600)          # a hang guard, not a budget: the state cap stops it, and says so
def test_a_state_blow_up_is_a_clear_error_not_a_hang():
    with pytest.raises(RegexTooComplex, match="automaton states"):
        compile_regex(r"[ab]*a[ab]{20}")
    assert compile_regex(r"[ab]*a[ab]{3}").num_states == 16      # 2^(3+1): the exponential family, small enough


def test_the_construction_cap_is_a_count_so_every_machine_gives_the_same_verdict():
    """The cap counts construction steps, not seconds: a pattern over a budget is refused (naming the budget) and
    under it accepted, whatever the machine's load; the verdict at the default budget is a fixed fact per pattern."""
    pattern = r"[ab]*a[ab]{8}"
    with pytest.raises(RegexTooComplex, match="steps of construction"):
        compile_regex(pattern, max_work=1_000)
    assert compile_regex(pattern, max_work=10**6).num_states == 2 ** 9
    verdicts = set()
    for _ in range(3):
        try:
            compile_regex(r"[ab]*a[ab]{12}", max_work=50_000)
            verdicts.add("accepted")
        except RegexTooComplex:
            verdicts.add("refused")
    assert verdicts == {"refused"}
