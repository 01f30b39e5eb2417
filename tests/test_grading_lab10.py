"""lab10 checkers, graded both ways: minillm's own Thompson construction, subset construction and token index pass
the property suites; plausible wrong versions of each are rejected with the diagnosis a learner needs; correct
learner versions written differently from minillm's pass."""
import numpy as np
import pytest

from minillm.grading.lab10 import (TASKS, check_lab10_1, check_lab10_2, check_lab10_3, first_difference,
                                   nfa_accepts, reference_token_walk)
from minillm.structured.automata import DEAD, DFA, NFA, compile_regex, determinize, utf8_sequences
from minillm.structured.regex import Alt, Chars, Concat, Repeat, parse
from minillm.structured.token_index import TokenIndex, VocabTrie, build_token_index
from grading_helpers import rejected


# ---------------------------------------------------------------- lab10_1 Thompson's construction

def test_lab10_1_minillm_nfa_passes():
    TASKS["lab10_1"].verify(lambda node, nfa: nfa.build(node))


def test_lab10_1_rejects_minillm_nfa():
    rejected(check_lab10_1, NFA.build, "minillm's own answer")
    rejected(check_lab10_1, lambda node, nfa: nfa.build(node), "runs minillm's own implementation")
    rejected(check_lab10_1, nfa_accepts, "minillm's own answer")


def thompson(node, nfa, *, chars="utf8", copies="fresh", optional_skip=True, star_skip=True, star_loop=True,
             alt="all", empty="ok", unbounded="loop"):
    """A learner's build_nfa (classic Thompson fragments: the end state never has outgoing edges) with switches
    for the classic mistakes."""
    kw = dict(chars=chars, copies=copies, optional_skip=optional_skip, star_skip=star_skip, star_loop=star_loop,
              alt=alt, empty=empty, unbounded=unbounded)

    def sub(n):
        return thompson(n, nfa, **kw)

    def link(a, b):
        nfa.eps[a].append(b)
    if isinstance(node, Chars):
        s, e = nfa.state(), nfa.state()
        for lo, hi in node.ranges:
            if chars == "codepoints":                  # one symbol per code point
                nfa.edges[s].append((lo, hi, e))
                continue
            if chars == "per_code_point":              # every code point of the range spelled out
                for cp in range(lo, hi + 1):
                    if not 0xD800 <= cp <= 0xDFFF:
                        data, at = chr(cp).encode("utf-8"), s
                        for b in data[:-1]:
                            nxt = nfa.state()
                            nfa.edges[at].append((b, b, nxt))
                            at = nxt
                        nfa.edges[at].append((data[-1], data[-1], e))
                continue
            if chars == "latin1":                      # bytes, but a code point is one byte
                if lo <= 255:
                    nfa.edges[s].append((lo, min(hi, 255), e))
                continue
            if chars == "endpoints":                   # one byte range per position, from the endpoints only
                seqs = []
                for a, b in [(lo, min(hi, 0x7F)), (max(lo, 0x80), min(hi, 0x7FF)), (max(lo, 0x800), min(hi, 0xFFFF)),
                             (max(lo, 0x10000), hi)]:
                    if a <= b and not (0xD800 <= a and b <= 0xDFFF):
                        x, y = chr(a).encode("utf-8", "surrogatepass"), chr(b).encode("utf-8", "surrogatepass")
                        seqs.append([(min(p, q), max(p, q)) for p, q in zip(x, y)])
            else:
                seqs = utf8_sequences(lo, hi)
            for seq in seqs:
                at = s
                for j, (b0, b1) in enumerate(seq):
                    nxt = e if j == len(seq) - 1 else nfa.state()
                    nfa.edges[at].append((b0, b1, nxt))
                    at = nxt
        return s, e
    if isinstance(node, Concat):
        if empty == "crash":
            s, e = sub(node.parts[0])
            for part in node.parts[1:]:
                ps, pe = sub(part)
                link(e, ps)
                e = pe
            return s, e
        if unbounded == "skip_from_body_start" and node.parts:     # lean: a concatenation starts at its first part
            s, e = sub(node.parts[0])
            for part in node.parts[1:]:
                ps, pe = sub(part)
                link(e, ps)
                e = pe
            return s, e
        s = e = nfa.state()
        for part in node.parts:
            ps, pe = sub(part)
            link(e, ps)
            e = pe
        return s, e
    if isinstance(node, Alt):
        s, e = nfa.state(), nfa.state()
        for option in (node.options[:1] if alt == "first" else node.options):
            os_, oe = sub(option)
            link(s, os_)
            link(oe, e)
        return s, e
    # Repeat
    s = e = nfa.state()
    shared = sub(node.node) if copies == "shared" else None

    def body():
        return shared if shared is not None else sub(node.node)
    for _ in range(node.min):
        bs, be = body()
        link(e, bs)
        e = be
    if node.max is None and node.min == 0 and unbounded == "skip_from_body_start":   # a leave state, no enter state
        bs, be = body()
        le = nfa.state()
        link(be, bs)
        link(be, le)
        link(bs, le)
        return bs, le
    if node.max is None and unbounded == "skip_from_body_start":
        unbounded = "loop"
    if node.max is None and unbounded == "unwrapped":        # no enter/leave states: skip and loop on the body
        bs, be = body()
        link(e, bs)
        link(bs, be)
        link(be, bs)
        e = be
    elif node.max is None and unbounded == "loop":
        bs, be = body()
        ls, le = nfa.state(), nfa.state()
        link(ls, bs)
        link(be, le)
        if star_loop:
            link(be, bs)
        if star_skip:
            link(ls, le)
        link(e, ls)
        e = le
    elif node.max is not None:
        for _ in range(node.max - node.min):
            bs, be = body()
            os_, oe = nfa.state(), nfa.state()
            link(os_, bs)
            link(be, oe)
            if optional_skip:
                link(os_, oe)
            link(e, os_)
            e = oe
    return s, e


def test_lab10_1_a_correct_thompson_construction_passes():
    check_lab10_1(lambda node, nfa: thompson(node, nfa))


NFA_WRONG = {
    "code points as symbols": (dict(chars="codepoints"), "you used code points as symbols"),
    "latin-1 bytes": (dict(chars="latin1"), "UTF-8"),
    "every code point spelled out": (dict(chars="per_code_point"), "never enumerate them one by one"),
    "one byte range per position": (dict(chars="endpoints"), "utf8_sequences(lo, hi)"),
    "one fragment for every copy": (dict(copies="shared"), "call build_nfa on the body once per copy"),
    "optional copies that cannot be skipped": (dict(optional_skip=False), "may each be left out"),
    "a star that needs one copy": (dict(star_skip=False), "x* matches zero copies too"),
    "a star that does not loop": (dict(star_loop=False), "x* repeats"),
    "only the first option": (dict(alt="first"), "alternation"),
    "the empty concatenation": (dict(empty="crash"), "raised IndexError"),
    "max None read as min": (dict(unbounded="ignore"), "x* repeats"),
    # right on every single loop, wrong on a loop whose body ends in a loop: (?:ab*)* then reads "b" alone
    "a loop without its own enter and leave states": (dict(unbounded="unwrapped"), "a loop inside a loop"),
    # a leave state but no enter state: the skip leaves from the body's start, which an inner loop at the start of
    # the body returns to — '(?:b*a)*' then accepts 'b'
    "a loop whose skip edge leaves from the body's start": (dict(unbounded="skip_from_body_start"),
                                                            "a loop whose body starts with a loop"),
}


@pytest.mark.parametrize("name", sorted(NFA_WRONG))
def test_lab10_1_wrong_constructions_fail_with_their_diagnosis(name):
    kw, diagnosis = NFA_WRONG[name]
    rejected(check_lab10_1, lambda node, nfa: thompson(node, nfa, **kw), diagnosis, "Hint")


def test_lab10_1_other_mistakes_fail():
    def own_nfa(node, nfa):                          # builds into an NFA of its own
        return thompson(node, NFA())
    rejected(check_lab10_1, own_nfa, "build_nfa returned")

    def numbered_from_zero(node, nfa):               # assumes the NFA was empty
        s, e = thompson(node, nfa)
        return 0, e
    rejected(check_lab10_1, numbered_from_zero, "existed before the call")

    def touches_old_states(node, nfa):
        s, e = thompson(node, nfa)
        if s > 0:
            nfa.eps[0].append(s)
        return s, e
    rejected(check_lab10_1, touches_old_states, "changed states that existed before")

    rejected(check_lab10_1, lambda node, nfa: list(thompson(node, nfa)) + [0], "must return (start, end)")
    rejected(check_lab10_1, lambda node, nfa: tuple(str(x) for x in thompson(node, nfa)), "must be an int")

    def edges_as_lists(node, nfa):                   # fine: an edge may be a list
        s, e = thompson(node, nfa)
        nfa.edges[:] = [[list(x) for x in row] for row in nfa.edges]
        return s, e
    check_lab10_1(edges_as_lists)


def desugaring(node, nfa):
    """A correct learner build_nfa written another way: a state per UTF-8 prefix for each code point sequence set,
    and Repeat rewritten into Concat / Alt / a single loop before building (every copy a new build call)."""
    if isinstance(node, Repeat):
        if node.max is None:
            loop_start = nfa.state()
            bs, be = desugaring(node.node, nfa)
            end = nfa.state()
            nfa.eps[loop_start] += [bs, end]
            nfa.eps[be] += [loop_start]
            if node.min == 0:
                return loop_start, end
            first_s, first_e = desugaring(Repeat(node.node, node.min, node.min), nfa)
            nfa.eps[first_e].append(loop_start)
            return first_s, end
        optional = Concat(())
        for _ in range(node.max - node.min):          # x{0,k} = (x(x(x)?)?)?
            optional = Alt((Concat((node.node, optional)), Concat(())))
        return desugaring(Concat((node.node,) * node.min + (optional,)), nfa)
    start = nfa.state()
    if isinstance(node, Chars):
        end = nfa.state()
        for lo, hi in node.ranges:
            for seq in utf8_sequences(lo, hi):
                states = [start] + [nfa.state() for _ in seq[:-1]] + [end]
                for (b0, b1), a, b in zip(seq, states, states[1:]):
                    nfa.edges[a].append((b0, b1, b))
        return start, end
    if isinstance(node, Concat):
        at = start
        for part in node.parts:
            ps, pe = desugaring(part, nfa)
            nfa.eps[at].append(ps)
            at = pe
        return start, at
    end = nfa.state()
    for option in node.options:
        os_, oe = desugaring(option, nfa)
        nfa.eps[start].append(os_)
        nfa.eps[oe].append(end)
    return start, end


def test_lab10_1_correct_learner_versions_pass():
    check_lab10_1(desugaring)


# ---------------------------------------------------------------- lab10_2 the subset construction

def test_lab10_2_minillm_determinize_passes():
    TASKS["lab10_2"].verify(lambda nfa, s, a: determinize(nfa, s, a))


def test_lab10_2_rejects_minillm_determinize():
    rejected(check_lab10_2, determinize, "minillm's own answer")
    rejected(check_lab10_2, lambda nfa, s, a: determinize(nfa, s, a), "runs minillm's own implementation")
    rejected(check_lab10_2, first_difference, "minillm's own answer")


def subsets(nfa, start, accept, *, start_closure=True, move_closure=True, depth=None, dead=DEAD, inclusive=True,
            dtype=np.int32, first_edge=False, bytes_=256, accepting="member", mutate=False):
    """A learner's subset construction (one pass over the 256 bytes per subset) with switches for the classic
    mistakes."""
    def closure(states):
        seen, frontier, level = set(states), list(states), 0
        while frontier and (depth is None or level < depth):
            level += 1
            nxt = []
            for s in frontier:
                for t in nfa.eps[s]:
                    if mutate:
                        nfa.eps[s] = list(nfa.eps[s])
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
            frontier = nxt
        return frozenset(seen)
    first = closure({start}) if start_closure else frozenset({start})
    ids, order, rows = {first: 0}, [first], []
    while len(rows) < len(order):
        cur = order[len(rows)]
        row = [dead] * 256
        for b in range(bytes_):
            targets = set()
            for s in cur:
                for lo, hi, t in nfa.edges[s]:
                    if lo <= b <= hi if inclusive else lo <= b < hi:
                        targets.add(t)
                        if first_edge:
                            break
            if targets:
                nxt = closure(targets) if move_closure else frozenset(targets)
                if nxt not in ids:
                    ids[nxt] = len(order)
                    order.append(nxt)
                row[b] = ids[nxt]
        rows.append(row)
    if mutate:
        nfa.eps.append([])
    acc = [accept in s if accepting == "member" else accept == max(s) for s in order]
    return DFA(np.array(rows, dtype=dtype), np.array(acc, dtype=bool), 0)


@pytest.mark.slow      # seconds: the checker's full run; the wrong answers stay in the fast set
def test_lab10_2_a_correct_subset_construction_passes():
    check_lab10_2(lambda nfa, s, a: subsets(nfa, s, a))


@pytest.mark.slow      # seconds: the checker's full run
def test_lab10_2_an_explicit_dead_state_passes():
    """A correct alternative (the lab text says so): a non-accepting sink state in place of DEAD."""
    def with_dead_state(nfa, s, a):
        d = subsets(nfa, s, a)
        sink = d.transitions.shape[0]
        rows = np.where(d.transitions == DEAD, sink, d.transitions)
        rows = np.vstack([rows, np.full((1, 256), sink)]).astype(np.int32)
        return DFA(rows, np.append(d.accepting, False), d.start)
    check_lab10_2(with_dead_state)


DET_WRONG = {
    "no closure of the start state": (dict(start_closure=False), "epsilon-closure of {start}"),
    "no closure after a move": (dict(move_closure=False), "after each move, follow epsilon edges"),
    "a closure one step deep": (dict(depth=1), "transitively"),
    "dead transitions to state 0": (dict(dead=0), "DEAD (-1) — not state 0"),
    "exclusive byte ranges": (dict(inclusive=False), "both ends included"),
    "only the first edge of a state": (dict(first_edge=True), "a SET of NFA states"),
    "ASCII bytes only": (dict(bytes_=128), "bytes above 0x7F too"),
    "int64 transitions": (dict(dtype=np.int64), "numpy int32 array"),
    "accepting when accept is the largest state": (dict(accepting="max"), "but the NFA"),
    "modifies the NFA": (dict(mutate=True), "changed the NFA"),
}


@pytest.mark.parametrize("name", sorted(DET_WRONG))
def test_lab10_2_wrong_constructions_fail_with_their_diagnosis(name):
    kw, diagnosis = DET_WRONG[name]
    rejected(check_lab10_2, lambda nfa, s, a: subsets(nfa, s, a, **kw), diagnosis)


def test_lab10_2_types_and_shapes():
    def as_lists(nfa, s, a):
        d = subsets(nfa, s, a)
        return DFA(d.transitions.tolist(), d.accepting, d.start)
    rejected(check_lab10_2, as_lists, "numpy int32 array")

    def int_accepting(nfa, s, a):
        d = subsets(nfa, s, a)
        return DFA(d.transitions, d.accepting.astype(np.int8), d.start)
    rejected(check_lab10_2, int_accepting, "numpy bool array")

    def bad_start(nfa, s, a):
        d = subsets(nfa, s, a)
        return DFA(d.transitions, d.accepting, d.num_states)
    rejected(check_lab10_2, bad_start, "is not a state of your DFA")

    rejected(check_lab10_2, lambda nfa, s, a: tuple(vars(subsets(nfa, s, a)).values()), "must be a minillm")

    def out_of_range(nfa, s, a):
        d = subsets(nfa, s, a)
        t = d.transitions.copy()
        t[t == DEAD] = d.num_states
        return DFA(t, d.accepting, d.start)
    rejected(check_lab10_2, out_of_range, "every entry is a state")


def byte_class_subsets(nfa, start, accept):
    """A correct learner subset construction written differently: recursion-free closure by repeated union, the
    bytes cut into classes at the NFA's range bounds, states found depth-first."""
    def closure(states):
        result = set(states)
        while True:
            more = {t for s in result for t in nfa.eps[s]} - result
            if not more:
                return frozenset(result)
            result |= more
    bounds = sorted({0, 256} | {x for row in nfa.edges for lo, hi, _ in row for x in (lo, hi + 1)})
    classes = list(zip(bounds, bounds[1:]))
    first = closure({start})
    index, stack, table = {first: 0}, [first], {}
    while stack:
        cur = stack.pop()
        row = np.full(256, DEAD, dtype=np.int32)
        for lo, hi in classes:
            tgt = {t for s in cur for a, z, t in nfa.edges[s] if a <= lo and hi - 1 <= z}
            if tgt:
                nxt = closure(tgt)
                if nxt not in index:
                    index[nxt] = len(index)
                    stack.append(nxt)
                row[lo:hi] = index[nxt]
        table[index[cur]] = row
    n = len(index)
    acc = np.zeros(n, dtype=bool)
    for subset, i in index.items():
        acc[i] = accept in subset
    return DFA(np.stack([table[i] for i in range(n)]), acc, 0)


@pytest.mark.slow      # seconds: the checker's full run; the wrong answers stay in the fast set
def test_lab10_2_correct_learner_versions_pass():
    check_lab10_2(byte_class_subsets)


def test_lab10_2_first_difference_finds_the_shortest_counterexample():
    nfa = NFA()
    s, e = nfa.build(parse("ab|é"))
    good = determinize(nfa, s, e)
    assert first_difference(good.transitions, good.accepting, good.start, nfa.edges, nfa.eps, s, e) is None
    bad = compile_regex("ab|è")
    assert first_difference(bad.transitions, bad.accepting, bad.start, nfa.edges, nfa.eps, s, e) == \
        ("è".encode(), True)


# ---------------------------------------------------------------- lab10_3 the token index

def test_lab10_3_minillm_token_index_passes():
    TASKS["lab10_3"].verify(build_token_index)


def test_lab10_3_rejects_minillm_token_index():
    rejected(check_lab10_3, build_token_index, "minillm's own answer")
    rejected(check_lab10_3, lambda dfa, vocab, eos: build_token_index(dfa, vocab, eos),
             "runs minillm's own implementation")

    def with_dfa_step(dfa, vocab, eos):                # DFA.step is minillm's walk
        allowed, nexts = [], []
        for s in range(dfa.num_states):
            ok = [(t, dfa.step(s, b)) for t, b in enumerate(vocab.token_bytes) if b]
            ok = [(t, n) for t, n in ok if n != DEAD]
            allowed.append(np.array([t for t, _ in ok], dtype=np.int64))
            nexts.append(np.array([n for _, n in ok], dtype=np.int64))
        return TokenIndex(dfa, allowed, nexts, tuple(eos), len(vocab.token_bytes))
    rejected(check_lab10_3, with_dfa_step, "runs minillm's own implementation")


def walk_index(dfa, vocab, eos_token_ids, *, prefix=False, eos_everywhere=False, pass_eos=True, specials=False,
               empty=False, next_after="all", decode=None, order="sorted", id_dtype=np.int64):
    """A learner's brute-force index (every token walked from every state, in Python) with switches for the classic
    mistakes."""
    T = dfa.transitions
    allowed, nexts = [], []
    for s in range(dfa.num_states):
        ok = {}
        for t, data in enumerate(vocab.token_bytes):
            if data is None:
                if not specials:
                    continue
                data = b""
            if data == b"" and not empty and not specials:
                continue
            if decode == "ignore":                    # a character-level walk: undecodable bytes dropped
                data = data.decode("utf-8", errors="ignore").encode("utf-8")
            elif decode == "skip":
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
            state, alive, first = s, s, None
            for b in data:
                state = int(T[state, b])
                if state == DEAD:
                    break
                alive = state
                first = state if first is None else first
            if state == DEAD and not (prefix and first is not None):
                continue
            ok[t] = {"all": alive, "first": first if first is not None else s, "start": s}[next_after]
        if eos_everywhere:
            for e in eos_token_ids:
                ok[e] = s
        items = sorted(ok.items(), reverse=(order == "reversed"))
        allowed.append(np.array([t for t, _ in items], dtype=np.int64).astype(id_dtype))
        nexts.append(np.array([n for _, n in items], dtype=np.int64))
    return TokenIndex(dfa, allowed, nexts, tuple(eos_token_ids) if pass_eos else (), len(vocab.token_bytes))


def revived(dfa, vocab, eos_token_ids):
    """A vectorized index that forgets DEAD is -1: transitions[-1] is the last state's row."""
    T = dfa.transitions
    ids = np.array([t for t, b in enumerate(vocab.token_bytes) if b], dtype=np.int64)
    allowed, nexts = [], []
    for s in range(dfa.num_states):
        after = []
        for t in ids:
            state = s
            for b in vocab.token_bytes[t]:
                state = int(T[state, b])
            after.append(state)
        after = np.array(after, dtype=np.int64)
        ok = after != DEAD
        allowed.append(ids[ok])
        nexts.append(after[ok])
    return TokenIndex(dfa, allowed, nexts, tuple(eos_token_ids), len(vocab.token_bytes))


@pytest.mark.slow      # seconds: the checker's full run; the wrong answers stay in the fast set
def test_lab10_3_a_correct_brute_force_passes():
    check_lab10_3(lambda d, v, e: walk_index(d, v, e))


INDEX_WRONG = {
    "a prefix is enough": (dict(prefix=True), "only a prefix of its bytes matches"),
    "EOS in every state": (dict(eos_everywhere=True), "EOS"),
    "EOS ids not passed on": (dict(pass_eos=False), "index.eos_token_ids"),
    "special tokens allowed": (dict(specials=True), "special token"),
    "empty tokens allowed": (dict(empty=True), "spells no bytes"),
    "next state after the first byte": (dict(next_after="first"), "FIRST byte"),
    "next state = the state it started from": (dict(next_after="start"), "the state you started from"),
    "a character-level walk": (dict(decode="ignore"), "part of a character"),
    "undecodable tokens skipped": (dict(decode="skip"), "never decode it to text"),
    "allowed ids not sorted": (dict(order="reversed"), "sorted ascending"),
    "16-bit token ids": (dict(id_dtype=np.uint16), "sorted ascending"),
}


@pytest.mark.parametrize("name", sorted(INDEX_WRONG))
def test_lab10_3_wrong_indexes_fail_with_their_diagnosis(name):
    kw, diagnosis = INDEX_WRONG[name]
    rejected(check_lab10_3, lambda d, v, e: walk_index(d, v, e, **kw), diagnosis)


def test_lab10_3_other_mistakes_fail():
    rejected(check_lab10_3, revived, "DEAD is -1")

    def lists(dfa, vocab, eos):
        idx = walk_index(dfa, vocab, eos)
        return TokenIndex(dfa, [a.tolist() for a in idx.allowed], idx.next_states, idx.eos_token_ids, idx.vocab_size)
    rejected(check_lab10_3, lists, "1-D numpy array of integers")

    def wrong_size(dfa, vocab, eos):
        idx = walk_index(dfa, vocab, eos)
        return TokenIndex(dfa, idx.allowed, idx.next_states, idx.eos_token_ids, idx.vocab_size + 1)
    rejected(check_lab10_3, wrong_size, "index.vocab_size")

    def other_dfa(dfa, vocab, eos):
        idx = walk_index(dfa, vocab, eos)
        return TokenIndex(DFA(dfa.transitions, ~dfa.accepting, dfa.start), idx.allowed, idx.next_states,
                          idx.eos_token_ids, idx.vocab_size)
    rejected(check_lab10_3, other_dfa, "index.dfa must be the DFA")

    def dead_next(dfa, vocab, eos):                 # a token that dies is listed, with DEAD as its next state
        idx = walk_index(dfa, vocab, eos)
        allowed = [np.append(a, len(vocab.token_bytes) - 1) for a in idx.allowed]
        nexts = [np.append(n, DEAD) for n in idx.next_states]
        return TokenIndex(dfa, allowed, nexts, idx.eos_token_ids, idx.vocab_size)
    rejected(check_lab10_3, dead_next, "is not a state of the DFA")

    rejected(check_lab10_3, lambda d, v, e: vars(walk_index(d, v, e)), "must be a minillm")


def trie_index(dfa, vocab, eos_token_ids):
    """A correct learner index written differently: a dict trie of the tokens, walked depth-first once per state
    (a dead prefix prunes its whole subtree)."""
    root: dict = {}
    for t, data in enumerate(vocab.token_bytes):
        if data:
            node = root
            for b in data:
                node = node.setdefault(b, {})
            node.setdefault(None, []).append(t)
    T = dfa.transitions.tolist()
    allowed, nexts = [], []
    for s in range(dfa.num_states):
        found = []
        stack = [(root, s)]
        while stack:
            node, state = stack.pop()
            for key, child in node.items():
                if key is None:
                    found += [(t, state) for t in child]
                elif T[state][key] != DEAD:
                    stack.append((child, T[state][key]))
        found.sort()
        allowed.append(np.array([t for t, _ in found], dtype=np.int32))
        nexts.append(np.array([n for _, n in found], dtype=np.int32))
    return TokenIndex(dfa, allowed, nexts, tuple(eos_token_ids), len(vocab.token_bytes))


@pytest.mark.slow      # seconds: the checker's full run; the wrong answers stay in the fast set
def test_lab10_3_correct_learner_versions_pass():
    check_lab10_3(trie_index)


def test_lab10_3_reference_walk_is_the_definition():
    d = compile_regex(r"\d{2}é")
    assert reference_token_walk(d.transitions, d.start, "12é".encode()) != DEAD
    assert d.accepting[reference_token_walk(d.transitions, d.start, "12é".encode())]
    assert reference_token_walk(d.transitions, d.start, b"1a") == DEAD
    assert reference_token_walk(d.transitions, d.start, b"") == d.start


# ---------------------------------------------------------------- the three composed, as the engine uses them

def test_the_pieces_compose_into_what_the_engine_builds():
    """A correct build_nfa + determinize + index, plugged together, give minillm's index on a small vocabulary: the
    same allowed tokens from the start state and along a walk."""
    vocab = VocabTrie.build([None, None, b"{", b'"', b"a", b'"a', b'a"', b"}", b"\xc3", b"\xa9", b"\xc3\xa9", b"1",
                             b"12", b": "])
    pattern = r'\{"(?:a|é)+": \d+\}'
    nfa = NFA()
    s, e = desugaring(parse(pattern), nfa)
    mine = walk_index(byte_class_subsets(nfa, s, e), vocab, (1,))
    ref = build_token_index(compile_regex(pattern), vocab, (1,))
    a, b = mine.dfa.start, ref.dfa.start
    for token in [2, 3, 10, 4, 6, 13, 12, 7]:       # {"éaa": 12}
        assert mine.allowed_token_ids(a).tolist() == ref.allowed_token_ids(b).tolist()
        a, b = mine.next_state(a, token), ref.next_state(b, token)
        assert a != DEAD and b != DEAD
    assert mine.is_accepting(a) and ref.is_accepting(b) and 1 in mine.allowed_token_ids(a).tolist()
