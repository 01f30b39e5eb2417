"""How long one engine step takes: the replica step-time model the fleet simulator runs on.

A step is *mixed*: chunked prefill puts prompt chunks and decodes in one forward pass (Sarathi-Serve). The weights
are read once for all of them, and the prefill tokens use the compute that a memory-bound decode leaves idle, so

    t = overhead + max(compute, memory)            (not compute + memory: they overlap inside one pass)
    overhead = o_step + o_seq x seqs + o_token x tokens          (Python, sampling, TP all-reduces: serial)
    compute  = c_token x tokens + c_pair x attention pairs + c_seq x seqs       (matmuls, QK^T / PV, logits)
    memory   = m_step + m_kv x KV tokens read                    (the weights once, every sequence's context)

with tokens = prefill + decode tokens of the step, attention pairs = (query, key) pairs the step attends over,
KV tokens read = the context each scheduled sequence reads. A fitted model may carry a second set of coefficients
for steps that run any prefill (`prefill_coeffs`): on a CPU the engine runs a decode-only step as one fused C call
and any other step through the model's layers (worker/model_runner.py), two code paths with different fixed and
per-sequence costs, so one set of coefficients for both would be wrong for one of them. Likewise a third set
(`short_prefill_coeffs`) for prefill steps of at most `short_prefill_tokens` tokens: the CPU's quantized layers run
up to 64 rows on the weights' tiles and more on an int16 copy, two kernels with different slopes (a 30-token prompt
ran ~12 % slower than one line through both predicted). The coefficients come
either from a fit to steps the real engine recorded (`fit`, minillm fleet calibrate) or from a roofline of a catalog
model on a catalog accelerator (`from_roofline`, through the estimator's datasheet arithmetic).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from minillm.fleet.estimator import (Deployment, Efficiency, _streamed_weight_bytes, forward_flops, memory_plan,
                                     tp_comm_seconds)

# The coefficients, in the order of the feature columns below (seconds per unit of each feature).
OVERHEAD = ("o_step", "o_seq", "o_token")
COMPUTE = ("c_token", "c_pair", "c_seq")
MEMORY = ("m_step", "m_kv")
COEFFS = OVERHEAD + COMPUTE + MEMORY
# What a fit on one machine can tell apart: no TP link (o_token), and per-sequence logits cost is inseparable
# from per-sequence overhead (o_seq takes both).
FITTED = ("o_step", "o_seq", "c_token", "c_pair", "m_step", "m_kv")
FORMS = ("max", "sum")


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes, summed over its scheduled sequences."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_tokens: int = 0        # context read: computed-before + new tokens, per sequence
    attn_pairs: int = 0       # sum over new tokens of the keys each attends to (causal)
    num_seqs: int = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int, int]]) -> "StepFeatures":
        """From (computed before, new tokens, prompt length) per scheduled sequence. A decode is one new token
        after the whole prompt; anything else (a prompt chunk, a preempted sequence's recompute) is prefill."""
        pre = dec = kv = pairs = seqs = 0
        for c, n, prompt_len in chunks:
            if n == 1 and c >= prompt_len:
                dec += 1
            else:
                pre += n
            kv += c + n
            pairs += n * c + n * (n + 1) // 2
            seqs += 1
        return cls(pre, dec, kv, pairs, seqs)

    def columns(self) -> dict[str, float]:
        """The feature each coefficient multiplies."""
        t = self.tokens
        return {"o_step": 1.0, "o_seq": self.num_seqs, "o_token": t, "c_token": t, "c_pair": self.attn_pairs,
                "c_seq": self.num_seqs, "m_step": 1.0, "m_kv": self.kv_tokens}


@dataclass(frozen=True)
class StepTrace:
    """One recorded step: its features and the wall time it took."""
    features: StepFeatures
    seconds: float


@dataclass(frozen=True)
class StepModel:
    """Seconds for a step, from its features. `form` "sum" (compute + memory) exists to be rejected by its fit
    error on mixed steps; the simulator uses "max". `replica` carries the pool and scheduler settings the model
    was measured with (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len)."""
    coeffs: dict[str, float]
    form: str = "max"
    source: str = ""
    replica: dict = field(default_factory=dict)
    fit_error: dict = field(default_factory=dict)   # median / p90 relative error on held-out steps
    prefill_coeffs: dict = field(default_factory=dict)   # for steps with prefill tokens; empty: `coeffs` for all
    short_prefill_coeffs: dict = field(default_factory=dict)   # for those of <= short_prefill_tokens tokens
    short_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        missing = set(COEFFS) - set(self.coeffs)
        for optional in (self.prefill_coeffs, self.short_prefill_coeffs):
            missing |= set(COEFFS) - set(optional or COEFFS)
        if missing or self.form not in FORMS:
            raise ValueError(f"a step model needs coefficients {', '.join(COEFFS)} (missing {sorted(missing)}) "
                             f"and a form in {FORMS} (got {self.form!r})")
        if bool(self.short_prefill_coeffs) != (self.short_prefill_tokens > 0) or \
                (self.short_prefill_coeffs and not self.prefill_coeffs):
            raise ValueError("short_prefill_coeffs come with short_prefill_tokens > 0 and with prefill_coeffs")

    def coeffs_for(self, f: StepFeatures) -> dict[str, float]:
        """The coefficient set for a step: decode-only, short prefill (<= short_prefill_tokens), or prefill."""
        if not f.prefill_tokens or not self.prefill_coeffs:
            return self.coeffs
        return self.short_prefill_coeffs if f.tokens <= self.short_prefill_tokens else self.prefill_coeffs

    def seconds(self, f: StepFeatures) -> float:
        k, t = self.coeffs_for(f), f.tokens
        over = k["o_step"] + k["o_seq"] * f.num_seqs + k["o_token"] * t
        comp = k["c_token"] * t + k["c_pair"] * f.attn_pairs + k["c_seq"] * f.num_seqs
        mem = k["m_step"] + k["m_kv"] * f.kv_tokens
        return over + (max(comp, mem) if self.form == "max" else comp + mem)

    def negative_step_error(self, f: StepFeatures, seconds: float) -> ValueError:
        """What a simulator raises when this model predicts `seconds` < 0 for a step of `f` (it cannot schedule a
        step that ends before it starts): which coefficients of that step's set are negative, and the fix."""
        k = self.coeffs_for(f)
        kind = ("decode-only" if k is self.coeffs else "short prefill" if k is self.short_prefill_coeffs
                else "prefill")
        negative = ", ".join(f"{n} = {v:.3g}" for n, v in k.items() if v < 0) or "none"
        return ValueError(f"the step model ({self.source or 'unnamed'}) predicts {seconds * 1e3:.3f} ms for a step of "
                          f"{f}: a step cannot take negative time. Its {kind} coefficients' negative ones: {negative}. "
                          "Fit with every coefficient >= 0 (a cost per token, pair or sequence is never negative; "
                          "minillm fleet calibrate's fit keeps them so)")

    def relative_errors(self, traces: Sequence[StepTrace]) -> np.ndarray:
        pred = np.array([self.seconds(t.features) for t in traces])
        real = np.array([t.seconds for t in traces])
        return np.abs(pred - real) / real

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "StepModel":
        d = json.loads(text)
        return cls(coeffs={k: float(v) for k, v in d["coeffs"].items()}, form=d.get("form", "max"),
                   source=d.get("source", ""), replica=dict(d.get("replica", {})),
                   fit_error=dict(d.get("fit_error", {})),
                   prefill_coeffs={k: float(v) for k, v in d.get("prefill_coeffs", {}).items()},
                   short_prefill_coeffs={k: float(v) for k, v in d.get("short_prefill_coeffs", {}).items()},
                   short_prefill_tokens=int(d.get("short_prefill_tokens", 0)))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "StepModel":
        try:
            return cls.from_json(Path(path).read_text())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not a step model saved by minillm fleet calibrate ({e})") from None


# ---------------------------------------------------------------------- fitting

def nnls(A: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """argmin ||Ax - b|| subject to x >= 0 (Lawson-Hanson active set; scipy is not a dependency). A step cost
    cannot be negative: an unconstrained fit would trade a negative coefficient against a collinear one."""
    m, n = A.shape
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(iters):
        w = A.T @ (b - A @ x)
        cand = ~passive & (w > 1e-12 * max(1.0, np.abs(w).max()))
        if not cand.any():
            break
        passive[np.argmax(np.where(cand, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def _design(features: Sequence[StepFeatures], compute_bound: np.ndarray, form: str) -> np.ndarray:
    """Rows = steps, columns = FITTED: under "max" a step's compute columns count only where it is compute bound
    and its memory columns only where it is memory bound (given the assignment); under "sum" both count."""
    rows = []
    for f, cb in zip(features, compute_bound):
        c = f.columns()
        use_c, use_m = (True, True) if form == "sum" else (bool(cb), not cb)
        rows.append([c[k] * (use_c if k in COMPUTE else use_m if k in MEMORY else 1) for k in FITTED])
    return np.array(rows, dtype=float)


def fit(traces: Sequence[StepTrace], form: str = "max", source: str = "fit", replica: dict | None = None,
        held_out: Sequence[StepTrace] = (), split: bool = False, short_prefill_tokens: int = 0) -> StepModel:
    """`_fit_one` over all steps, or with `split`, one fit over the decode-only steps (`coeffs`) and one over the
    steps with prefill tokens (`prefill_coeffs`), each with enough steps (else one fit for all); and with
    `short_prefill_tokens`, the prefill steps of at most that many tokens fitted apart (`short_prefill_coeffs`),
    when both sides of the line have enough steps."""
    enough = lambda group: len(group) >= 2 * len(FITTED)     # noqa: E731
    pre = [t for t in traces if t.features.prefill_tokens]
    dec = [t for t in traces if not t.features.prefill_tokens]
    short = [t for t in pre if t.features.tokens <= short_prefill_tokens]
    long = [t for t in pre if t.features.tokens > short_prefill_tokens]
    if split and enough(pre) and enough(dec):
        best = replace(_fit_one(dec, form, source, replica), prefill_coeffs=_fit_one(pre, form).coeffs)
        if short_prefill_tokens > 0 and enough(short) and enough(long):
            best = replace(best, prefill_coeffs=_fit_one(long, form).coeffs,
                           short_prefill_coeffs=_fit_one(short, form).coeffs, short_prefill_tokens=short_prefill_tokens)
    else:
        best = _fit_one(traces, form, source, replica)
    if held_out:
        e = best.relative_errors(held_out)
        best = replace(best, fit_error={"median": float(np.median(e)), "p90": float(np.quantile(e, 0.9)),
                                        "steps": len(held_out)})
    return best


def _fit_one(traces: Sequence[StepTrace], form: str = "max", source: str = "fit", replica: dict | None = None
             ) -> StepModel:
    """Least squares (relative error: each row divided by its time) with non-negative coefficients. "max" is
    piecewise linear: alternate between assigning each step to the bound that is larger under the current
    coefficients and refitting (k-plane regression), from several starts; keep the best."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if len(traces) < len(FITTED):
        raise ValueError(f"fitting {len(FITTED)} coefficients needs at least as many steps, got {len(traces)}")
    feats = [t.features for t in traces]
    y = np.array([t.seconds for t in traces], dtype=float)
    w = 1 / y

    def solve(assign: np.ndarray) -> tuple[StepModel, float]:
        A = _design(feats, assign, form)
        x = nnls(A * w[:, None], y * w)
        coeffs = dict.fromkeys(COEFFS, 0.0) | dict(zip(FITTED, map(float, x)))
        m = StepModel(coeffs, form, source, dict(replica or {}))
        return m, float(np.sum(m.relative_errors(traces) ** 2))

    if form == "sum":
        best, _ = solve(np.ones(len(feats), bool))
    else:
        tok = np.array([f.tokens for f in feats], float)
        kv = np.array([f.kv_tokens for f in feats], float)
        starts = [np.ones(len(feats), bool), np.zeros(len(feats), bool)]
        starts += [tok > np.quantile(tok, q) for q in (0.25, 0.5, 0.75)]
        starts += [tok / np.maximum(kv, 1) > r for r in (0.1, 0.5)]
        best, best_err = None, np.inf
        for assign in starts:
            for _ in range(30):
                m, err = solve(assign)
                if err < best_err:
                    best, best_err = m, err
                k = m.coeffs
                new = np.array([k["c_token"] * f.tokens + k["c_pair"] * f.attn_pairs >= k["m_step"] + k["m_kv"] *
                                f.kv_tokens for f in feats])
                if (new == assign).all():
                    break
                assign = new
    return best


# ---------------------------------------------------------------------- roofline

def from_roofline(model: str, hardware: str, weight_format: str = "bf16", tp: int = 1,
                  eff: Efficiency = Efficiency(), block_size: int = 16, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 8192, overhead_s: float = 0.0) -> StepModel:
    """The coefficients of a catalog model on a catalog accelerator: the estimator's forward-pass arithmetic
    (minillm.fleet.estimator.forward_time, which is linear in its inputs) read off at unit inputs. `overhead_s`
    is a fixed per-step cost the datasheet cannot know (scheduling, launch); the pool is what memory_plan leaves."""
    dep = Deployment(model, hardware, tp=tp, weights=weight_format)
    flops_s = tp * dep.gpu.peak_flops(dep.format.compute) * eff.mfu
    bw = dep.gpu.hbm_gb_s * 1e9 * eff.mbu
    kv_per_token_gpu = memory_plan(dep).kv_bytes_per_token / tp
    weights_gpu = _streamed_weight_bytes(dep) / tp   # the estimator's rule: all but an untied embedding
    comm_latency = tp_comm_seconds(dep, 0, eff)
    coeffs = {
        "o_step": overhead_s + comm_latency,
        "o_seq": 0.0,
        "o_token": tp_comm_seconds(dep, 1, eff) - comm_latency,
        "c_token": forward_flops(dep.config, 1, 0, 0) / flops_s,
        "c_pair": forward_flops(dep.config, 0, 1, 0) / flops_s,
        "c_seq": forward_flops(dep.config, 0, 0, 1) / flops_s,     # one logits row per sequence at most
        "m_step": weights_gpu / bw,
        "m_kv": kv_per_token_gpu / bw,
    }
    plan = memory_plan(dep)
    if plan.kv_tokens < block_size:
        raise ValueError(f"{dep.config.name} in {weight_format} on {tp} x {dep.gpu.name} leaves no room for a KV "
                         f"pool ({plan.kv_gb:.1f} GB): raise --tp or pick a smaller weight format")
    replica = {"num_blocks": plan.kv_tokens // block_size, "block_size": block_size, "max_num_seqs": max_num_seqs,
               "max_num_batched_tokens": max_num_batched_tokens,
               "max_model_len": min(dep.config.max_position_embeddings, plan.kv_tokens),
               "kv_bytes_per_token": plan.kv_bytes_per_token}     # whole replica: what a KV transfer ships
    return StepModel(coeffs, "max", f"roofline: {dep.config.name} {weight_format} on {tp} x {dep.gpu.name}", replica)

