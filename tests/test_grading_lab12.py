"""lab12 checkers, graded both ways: minillm's own step-model fit and prefix-aware router pass the property suites;
handed in as answers they are refused, and so are plausible wrong answers (a fit that ignores the KV tokens, sums
compute and memory or reports milliseconds; a router that hashes the whole prompt, or its partial last block, or
only its first block, has no load bound or an off-by-one one, hashes modulo the replica count, ignores that the fleet
shrank, puts one point per replica on its ring, ...). Correct answers written other natural ways pass (plain least
squares or non-negative least squares, weighted or not; a different ring, rendezvous hashing)."""
import bisect
import hashlib
import math

import numpy as np
import pytest

from minillm.fleet.routers import LeastTokens, PrefixAware
from minillm.fleet.step_model import COEFFS, StepModel, fit, nnls
from minillm.grading.lab12 import FITTED, TASKS, check_lab12_1, check_lab12_2
from minillm.kv.prefix_cache import default_hash_fn
from grading_helpers import rejected


# ---------------------------------------------------------------- lab12_1 fitting the step model

def _rows(traces, compute_bound, kv=True, form="max"):
    rows = []
    for t, cb in zip(traces, compute_bound):
        f = t.features
        c, m = (1.0, 1.0) if form == "sum" else (float(cb), float(not cb))
        rows.append([1.0, f.num_seqs, c * f.tokens, c * f.attn_pairs, m, m * f.kv_tokens * kv])
    return np.array(rows)


def alternating(traces, solve=lambda A, b: np.linalg.lstsq(A, b, rcond=None)[0], weighted=True, kv=True,
                form="max", rounds=30, starts=(0.01, 0.1, 0.5)):
    """The max form in rounds: assign each step to its larger bound, solve, reassign (several starting guesses)."""
    y = np.array([t.seconds for t in traces])
    w = 1 / y if weighted else np.ones_like(y)
    ratio = np.array([t.features.tokens / max(t.features.kv_tokens, 1) for t in traces])
    best, best_err = None, math.inf
    for guess in ([ratio > r for r in starts] if form == "max" else [np.ones(len(y), bool)]):
        for _ in range(rounds):
            x = solve(_rows(traces, guess, kv, form) * w[:, None], y * w)
            k = dict(zip(FITTED, map(float, x)))
            pred = np.array([k["o_step"] + k["o_seq"] * t.features.num_seqs + (max if form == "max" else sum)(
                (k["c_token"] * t.features.tokens + k["c_pair"] * t.features.attn_pairs,
                 k["m_step"] + k["m_kv"] * t.features.kv_tokens)) for t in traces])
            err = float(np.sum(((pred - y) / y) ** 2))
            if err < best_err:
                best, best_err = k, err
            new = np.array([k["c_token"] * t.features.tokens + k["c_pair"] * t.features.attn_pairs >=
                            k["m_step"] + k["m_kv"] * t.features.kv_tokens for t in traces])
            if (new == guess).all() or form == "sum":
                break
            guess = new
    return best


def test_lab12_1_minillm_passes_and_is_refused_as_an_answer():
    def minillms(traces):
        return {k: fit(traces).coeffs[k] for k in FITTED}
    TASKS["lab12_1"].verify(minillms)
    rejected(check_lab12_1, minillms, "minillm's own")
    rejected(check_lab12_1, fit, "minillm's own answer")


def test_lab12_1_correct_alternatives_pass():
    check_lab12_1(alternating)                                           # numpy lstsq, unconstrained
    check_lab12_1(lambda traces: alternating(traces, solve=nnls))        # non-negative least squares
    check_lab12_1(lambda traces: alternating(traces, weighted=False))    # absolute, not relative, error


FIT_WRONG = {
    "ignores_kv_tokens": (lambda tr: alternating(tr, kv=False), "ignores the KV tokens"),
    "sums_compute_and_memory": (lambda tr: alternating(tr, form="sum"), "compute + memory"),
    "milliseconds": (lambda tr: {k: 1000 * v for k, v in alternating(tr).items()}, "not milliseconds"),
    "one_straight_line": (lambda tr: dict(zip(FITTED, np.linalg.lstsq(
        np.array([[1, t.features.num_seqs, t.features.tokens, t.features.attn_pairs, 0, t.features.kv_tokens]
                  for t in tr], float), np.array([t.seconds for t in tr]), rcond=None)[0].tolist())), "p90"),
    "one_guess_never_revised": (lambda tr: alternating(tr, rounds=1), "p90"),
    "starts_all_memory_bound": (lambda tr: alternating(tr, starts=(math.inf,)), "every step memory bound"),
    "a_step_model": (lambda tr: StepModel(dict.fromkeys(COEFFS, 0.0) | alternating(tr)), "must return a dict"),
    "a_list": (lambda tr: list(alternating(tr).values()), "must return a dict"),
    "missing_a_key": (lambda tr: {k: v for k, v in alternating(tr).items() if k != "o_seq"}, "exactly the keys"),
}


@pytest.mark.parametrize("name", FIT_WRONG)
def test_lab12_1_wrong_implementations_fail(name):
    fn, needle = FIT_WRONG[name]
    rejected(check_lab12_1, fn, needle)


# ---------------------------------------------------------------- lab12_2 the prefix-aware router

def _h(text) -> int:
    return int.from_bytes(hashlib.sha256(str(text).encode()).digest()[:8], "big")


class Ring:
    """A correct router written independently: sha256 ring with 100 points per replica, the prefix as bytes."""

    vnodes = 100

    def __init__(self, num_replicas, block_size, prefix_blocks, epsilon):
        self.bs, self.pb, self.eps = block_size, prefix_blocks, epsilon
        ring = sorted((_h(f"r{r}/{v}"), r) for r in range(num_replicas) for v in range(self.vnodes))
        self.points, self.owners = [p for p, _ in ring], [r for _, r in ring]

    def key(self, prompt):
        n = min(self.pb, len(prompt) // self.bs)
        return None if n == 0 else _h(prompt[:n * self.bs])

    def cap(self, replicas):
        return math.ceil((1 + self.eps) * (sum(r.num_requests for r in replicas) + 1) / len(replicas))

    def candidates(self, key, n):
        start = bisect.bisect(self.points, key)
        for j in range(len(self.points)):
            r = self.owners[(start + j) % len(self.points)]
            if r < n:
                yield r

    def route(self, request, replicas):
        key = self.key(request.prompt)
        if key is None:
            return min(range(len(replicas)), key=lambda i: (replicas[i].outstanding_tokens, i))
        cap = self.cap(replicas)
        return next(r for r in self.candidates(key, len(replicas)) if replicas[r].num_requests < cap)


class ChainedKey(Ring):
    """The prefix cache's own chained block hash for the key, 32 points per replica."""
    vnodes = 32

    def key(self, prompt):
        h = None
        for i in range(min(self.pb, len(prompt) // self.bs)):
            h = default_hash_fn(h, prompt[i * self.bs:(i + 1) * self.bs])
        return None if h is None else h % 2**64


class Rendezvous(Ring):
    """Highest random weight: replicas in the order of hash(key, replica); the first under the bound."""

    def candidates(self, key, n):
        return sorted(range(n), key=lambda r: -_h((key, r)))


def test_lab12_2_minillm_passes_and_is_refused_as_an_answer():
    TASKS["lab12_2"].verify(PrefixAware)
    rejected(check_lab12_2, PrefixAware, "minillm's own answer")


@pytest.mark.parametrize("router", [Ring, ChainedKey, Rendezvous])
def test_lab12_2_correct_alternatives_pass(router):
    check_lab12_2(router)


def _variant(**methods):
    return type("PrefixRouter", (Ring,), methods)


def _whole_prompt(self, prompt):
    return _h(prompt) if len(prompt) >= self.bs else None


def _ring_of_the_start(self, key, n):
    start = bisect.bisect(self.points, key)
    return (self.owners[(start + j) % len(self.points)] for j in range(len(self.points)))


def _any_owner(self, request, replicas):
    """The ring of the replicas there were: a replica that left is still returned (its load read as 0)."""
    cap, key = self.cap(replicas), self.key(request.prompt)
    if key is None:
        return Ring.route(self, request, replicas)
    return next(r for r in _ring_of_the_start(self, key, 0) if r >= len(replicas) or replicas[r].num_requests < cap)


class Stateful(Ring):
    def __init__(self, *args):
        super().__init__(*args)
        self.turn = 0

    def route(self, request, replicas):
        self.turn += 1
        return self.turn % len(replicas)


ROUTER_WRONG = {
    "hashes_the_whole_prompt": (_variant(key=_whole_prompt), "hashing the whole prompt"),
    "hashes_the_partial_block": (_variant(key=lambda self, p: _h(p[:self.pb * self.bs]) if len(p) >= self.bs
                                          else None), "partial last block"),
    "first_block_only": (_variant(key=lambda self, p: _h(p[:self.bs]) if len(p) >= self.bs else None),
                         "share only their first block"),
    "no_load_bound": (_variant(cap=lambda self, replicas: math.inf), "must pass the request on"),
    "bound_off_by_one": (_variant(cap=lambda self, replicas: Ring.cap(self, replicas) + 1),
                         "must pass the request on"),
    "mean_without_the_new_request": (_variant(cap=lambda self, replicas: math.ceil(
        (1 + self.eps) * sum(r.num_requests for r in replicas) / len(replicas))), "raised StopIteration"),
    "modulo_the_replica_count": (_variant(candidates=lambda self, key, n: iter(
        [(key + i) % n for i in range(n)])), "consistent hashing moves only"),
    "ignores_that_the_fleet_shrank": (_variant(candidates=_ring_of_the_start), "IndexError"),
    "returns_a_replica_that_left": (_variant(route=_any_owner), "an index into the replicas"),
    "one_point_per_replica": (type("PrefixRouter", (Ring,), {"vnodes": 1}), "virtual nodes"),
    "short_prompts_to_replica_0": (_variant(route=lambda self, req, reps: 0 if len(req.prompt) < self.bs
                                            else Ring.route(self, req, reps)), "fewest outstanding tokens"),
    "round_robin": (Stateful, "no turn counter"),
    "least_tokens_only": (_variant(route=lambda self, req, reps: LeastTokens().route(req, reps)),
                          "so it stays there"),
    "returns_a_float": (_variant(route=lambda self, req, reps: float(Ring.route(self, req, reps))),
                        "must be an int"),
}


@pytest.mark.parametrize("name", ROUTER_WRONG)
def test_lab12_2_wrong_implementations_fail(name):
    cls, needle = ROUTER_WRONG[name]
    rejected(check_lab12_2, cls, needle)
