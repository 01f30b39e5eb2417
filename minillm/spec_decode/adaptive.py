"""Adaptive speculation (num_speculative_tokens="auto"): how many tokens to draft for each sequence, each step.

Speculation pays only while the tokens a step is expected to emit grow faster than what the step costs. With
per-token acceptance a, k drafts emit (1 - a^(k+1)) / (1 - a) tokens; the j-th draft adds a^j of them. The cost
is the engine's own: a plain decode step at this batch size, what verifying extra rows adds (a fixed jump -- the
verification's own work, such as scoring its rows through the rejection sampler -- then a cost per row: on a CPU each
row multiplies every weight again) and the drafting (one forward per draft token for a model; about nothing for
n-gram lookup). Both are learned online from the engine's step times.

Each step, every decoding sequence's drafts are ranked by expected gain a_i^j (gains fall with j, so the best E
rows are the E largest gains) and the E that maximises expected tokens per second is taken; E = 0 (a plain step)
unless speculation beats it by a margin, so drafts expected to lose are never paid for.

k is chosen before the step's random draws, from past outcomes only (acceptance so far, step times), so the
rejection sampler's output stays distributed exactly as the target's.

A sequence at k = 0 keeps measuring: where drafting is cheap (n-gram), its would-be first draft is checked
against the token the plain step emits (a shadow draft: for a deterministic guess, matching the emitted token has
exactly the probability of being accepted); where drafting costs a forward, it is re-evaluated every few idle
steps as if its acceptance had recovered (a probe), and gets k = 1 if that would pay.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

PRIOR_ACCEPTANCE = 0.5      # a fresh request's guess before the engine has measured any
PRIOR_WEIGHT = 2.0          # how many observed tokens that guess is worth
DECAY = 0.9                 # per step: acceptance drifts within a request (copying, then free text)
PRIOR_JUMP = 0.3            # before any verification is timed: a verifying step costs 1.3 plain steps,
PRIOR_PER_ROW = 0.05        # plus 0.05 per extra row (CPU-like; the measurements replace it within a few steps)
MARGIN = 0.03               # speculate only when it beats a plain step by 3%: timing noise must not flip it
CHEAP_DRAFT = 0.05          # a draft round under 5% of a plain step counts as free: shadow-draft idle sequences
PROBE_EVERY, PROBE_MAX = 8, 128     # idle steps between probes (doubling after a failed one)
PROBE_ACCEPTANCE = 0.9      # a probe evaluates the sequence as if its drafts were this good again
PLAIN_SAMPLES = 3           # plain steps timed at a batch size before its cost is trusted (the first is often cold)
PLAIN_REFRESH = 32          # while speculating, one plain step in this many keeps the plain cost current


@dataclass
class Acceptance:
    """Per-token acceptance, decayed: `hits` accepted drafts out of `trials` tried (a draft is tried only if the
    ones before it were accepted, so trials = accepted + 1 per step that rejected one)."""
    hits: float = 0.0
    trials: float = 0.0

    def observe(self, num_drafts: int, num_accepted: int, decay: float = DECAY) -> None:
        if num_drafts < 1:
            return
        self.hits = self.hits * decay + num_accepted
        self.trials = self.trials * decay + num_accepted + (num_accepted < num_drafts)

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.hits + prior * weight) / (self.trials + weight)


class StepCosts:
    """Step times learned online: a plain decode step per batch size (the median of its recent ones: robust to a
    cold first step and to bursts of load), a line `jump + per_row * extra rows` for what verification adds (least
    squares over recent steps), and a draft round per batch size (EMA)."""

    def __init__(self, ema: float = 0.2, window: int = 48) -> None:
        self.ema, self.window = ema, window
        self.plain_samples: dict[int, deque[float]] = {}
        self.draft_s: dict[int, float] = {}
        self.verify_samples: deque[tuple[int, int, float]] = deque(maxlen=window)   # (batch, extra rows, seconds)

    def record_step(self, num_seqs: int, num_rows: int, seconds: float) -> None:
        """A decode-only step (drafting excluded) of num_seqs sequences and num_rows rows in all."""
        if num_rows == num_seqs:
            self.plain_samples.setdefault(num_seqs, deque(maxlen=9)).append(seconds)
        elif num_rows > num_seqs:
            self.verify_samples.append((num_seqs, num_rows - num_seqs, seconds))

    def record_draft(self, num_seqs: int, rounds: int, seconds: float) -> None:
        if rounds >= 1:
            self._ema(self.draft_s, num_seqs, seconds / rounds)

    def _ema(self, table: dict[int, float], key: int, value: float) -> None:
        table[key] = value if key not in table else (1 - self.ema) * table[key] + self.ema * value

    @property
    def plain_s(self) -> dict[int, float]:
        """Seconds of a plain decode step per measured batch size."""
        return {b: sorted(v)[len(v) // 2] for b, v in self.plain_samples.items()}

    def knows_plain(self, batch: int) -> bool:
        """Plain steps were timed at a batch size within a factor 2 of this one (close enough to interpolate)."""
        return any(b / 2 <= batch <= 2 * b and len(v) >= PLAIN_SAMPLES for b, v in self.plain_samples.items())

    def plain(self, batch: int) -> Optional[float]:
        return _interpolate(self.plain_s, batch)

    def draft(self, batch: int) -> float:
        """Seconds per draft round (0 until one was timed: try drafting, then know)."""
        return _interpolate(self.draft_s, batch) or 0.0

    def verify_line(self, batch: int) -> tuple[float, float]:
        """(jump, seconds per extra row) that verification adds to a plain step at this batch size."""
        plain = self.plain(batch) or 1.0
        plain_s = self.plain_s
        pts = [(x, t - p) for b, x, t in self.verify_samples if (p := _interpolate(plain_s, b)) is not None]
        if not pts:
            return PRIOR_JUMP * plain, PRIOR_PER_ROW * plain
        xs = {x for x, _ in pts}
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        if len(xs) == 1:               # one width seen: split it as the prior does
            per_row = max(my, 0.0) / (PRIOR_JUMP / PRIOR_PER_ROW + mx)
        else:
            per_row = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
            per_row = max(per_row, 0.0)
        return max(my - per_row * mx, 0.0), per_row


def _interpolate(table: dict[int, float], key: int) -> Optional[float]:
    """Linear between the nearest measured keys around `key`; the nearest one outside them; None if empty."""
    if key in table or not table:
        return table.get(key)
    lo = max((k for k in table if k < key), default=None)
    hi = min((k for k in table if k > key), default=None)
    if lo is None or hi is None:
        return table[lo if hi is None else hi]
    return table[lo] + (table[hi] - table[lo]) * (key - lo) / (hi - lo)


@dataclass
class Costs:
    """One step's cost model at a batch size, in seconds: plain step, verification's jump and per-row cost, one
    draft round."""
    plain: float
    jump: float
    per_row: float
    draft_round: float = 0.0

    def step(self, extra_rows: int, rounds: int) -> float:
        if extra_rows == 0:
            return self.plain
        return self.plain + self.jump + self.per_row * extra_rows + self.draft_round * rounds


def choose_ks(acceptance: list[float], caps: list[int], costs: Costs, margin: float = MARGIN) -> list[int]:
    """Drafts per sequence maximising expected tokens per second for a step of len(acceptance) decoding sequences;
    caps[i] bounds sequence i's k (k_max, max_tokens, context). All zeros unless that beats a plain step by
    `margin`."""
    gains = sorted((-(a ** j), i, j) for i, (a, cap) in enumerate(zip(acceptance, caps)) for j in range(1, cap + 1))
    tokens, rounds = float(len(acceptance)), 0
    plain_rate = tokens / costs.plain
    best_rate, best_e = plain_rate * (1 + margin), 0
    for e, (neg_gain, _, j) in enumerate(gains, 1):
        tokens -= neg_gain
        rounds = max(rounds, j)
        rate = tokens / costs.step(e, rounds)
        if rate > best_rate:
            best_rate, best_e = rate, e
    ks = [0] * len(acceptance)
    for _, i, j in gains[:best_e]:
        ks[i] = max(ks[i], j)
    return ks


@dataclass
class SeqState:
    acceptance: Acceptance = field(default_factory=Acceptance)
    idle: int = 0                     # steps in a row at k = 0
    probe_every: int = PROBE_EVERY
    probing: bool = False             # this step's k = 1 is a probe
    shadow: Optional[int] = None      # this step's unverified first guess (checked against the emitted token)


class AdaptiveK:
    """The policy behind num_speculative_tokens="auto": per-sequence acceptance, the engine's step costs, and the
    choice of k each step (SpecDecoder calls choose, then observes what happened)."""

    def __init__(self, k_max: int, costs: Optional[StepCosts] = None) -> None:
        self.k_max = k_max
        self.costs = costs or StepCosts()
        self.engine_acceptance = Acceptance()       # a fresh request's prior: what this engine's requests measured
        self.seqs: dict[int, SeqState] = {}
        self.steps_since_plain = 0

    def state(self, seq_id: int) -> SeqState:
        if seq_id not in self.seqs:
            self.seqs[seq_id] = SeqState()
        return self.seqs[seq_id]

    def prior(self) -> float:
        return self.engine_acceptance.rate(PRIOR_ACCEPTANCE)

    def acceptance(self, seq_id: int) -> float:
        return self.state(seq_id).acceptance.rate(self.prior())

    def cost_model(self, batch: int) -> Costs:
        c = self.costs
        jump, per_row = c.verify_line(batch)
        return Costs(c.plain(batch) or 1.0, jump, per_row, c.draft(batch))

    def drafting_is_cheap(self, batch: int) -> bool:
        m = self.cost_model(batch)
        return m.draft_round <= CHEAP_DRAFT * m.plain

    def choose(self, seq_ids: list[int], caps: list[int]) -> list[int]:
        """k per decoding sequence this step (caps already include k_max, max_tokens and the context)."""
        batch = len(seq_ids)
        self.steps_since_plain += 1
        # time plain steps at this batch size first, and now and then again (load on the machine changes)
        if not self.costs.knows_plain(batch) or self.steps_since_plain > PLAIN_REFRESH:
            self.steps_since_plain = 0
            return [0] * batch
        states = [self.state(s) for s in seq_ids]
        shadowing = self.drafting_is_cheap(batch)
        rates = []
        for st in states:
            st.probing = not shadowing and st.idle >= st.probe_every
            rate = st.acceptance.rate(self.prior())
            rates.append(max(rate, PROBE_ACCEPTANCE) if st.probing else rate)
        ks = []
        for st, k in zip(states, choose_ks(rates, caps, self.cost_model(batch))):
            if st.probing:
                k = min(k, 1)
                if not k:                # would not pay even if its drafts were good again: wait longer
                    st.probing, st.idle, st.probe_every = False, 0, min(2 * st.probe_every, PROBE_MAX)
            st.idle = 0 if k else st.idle + 1
            ks.append(k)
        if not any(ks):
            self.steps_since_plain = 0
        return ks

    def observe(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A verification step: num_accepted of seq's num_drafts guesses were kept."""
        st = self.state(seq_id)
        st.acceptance.observe(num_drafts, num_accepted)
        self.engine_acceptance.observe(num_drafts, num_accepted)
        if st.probing:
            st.probing = False
            st.probe_every = PROBE_EVERY if num_accepted else min(2 * st.probe_every, PROBE_MAX)

    def observe_shadow(self, seq_id: int, emitted: int) -> None:
        """A plain step emitted `emitted` where seq had an unverified first guess."""
        st = self.state(seq_id)
        if st.shadow is not None:
            self.observe(seq_id, 1, int(st.shadow == emitted))
            st.shadow = None

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
