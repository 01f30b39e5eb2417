"""Spaced repetition: SM-2 (SuperMemo 2) per question id, and the order a round asks questions in.

SM-2 keeps, per card, an ease factor (>= 1.3), a repetition count and an interval in days. A passing grade
grows the interval (1 day, 6 days, then previous x ease); a failing grade restarts the card at one day.
The learner rates themselves with four words, mapped onto SM-2's 0-5 grades.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable, Protocol, Sequence

RATINGS: dict[str, int] = {"again": 1, "hard": 3, "good": 4, "easy": 5}   # SM-2 grade q in 0..5; < 3 fails
MIN_EASE = 1.3
MAX_INTERVAL_DAYS = 36500   # a century, Anki's ceiling too: SM-2's growth is unbounded, dates are not
START_EASE = 2.5

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class Card:
    ease: float = START_EASE
    repetitions: int = 0      # consecutive passing reviews
    interval: int = 0         # days until the next review
    due: str = ""             # ISO-8601 UTC; "" = never reviewed
    reviews: int = 0
    lapses: int = 0           # times rated "again"
    last_rating: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> "Card":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def due_at(self) -> datetime | None:
        return datetime.fromisoformat(self.due) if self.due else None


def _days_after(now: datetime, days: int) -> datetime:
    """now + days, or the last date a datetime holds when that is past year 9999 (a schedule file from a clock
    far in the future must not crash the quiz)."""
    try:
        return now + timedelta(days=days)
    except OverflowError:
        return datetime.max.replace(tzinfo=now.tzinfo)


def sm2(card: Card, rating: str, now: datetime) -> Card:
    """The card after one review: SM-2's update, with `rating` one of again/hard/good/easy."""
    if rating not in RATINGS:
        raise ValueError(f"unknown rating {rating!r}; use one of {', '.join(RATINGS)}")
    q = RATINGS[rating]
    # SM-2's ease update: +0.1 for q=5, 0 for q=4, -0.14 for q=3, -0.54 for q=1; never below 1.3.
    ease = max(MIN_EASE, card.ease + 0.1 - (5 - q) * (0.08 + (5 - q) * 0.02))
    if q < 3:
        repetitions, interval = 0, 1
    else:
        repetitions = card.repetitions + 1
        interval = 1 if repetitions == 1 else 6 if repetitions == 2 else max(1, round(card.interval * ease))
        interval = min(interval, MAX_INTERVAL_DAYS)
    return Card(ease=round(ease, 4), repetitions=repetitions, interval=interval,
                due=_days_after(now, interval).isoformat(), reviews=card.reviews + 1,
                lapses=card.lapses + (q < 3), last_rating=rating)


class HasIdLevel(Protocol):
    id: str
    level: str


@dataclass
class Schedule:
    cards: dict[str, Card]
    clock: Clock = utc_now

    @classmethod
    def empty(cls, clock: Clock = utc_now) -> "Schedule":
        return cls({}, clock)

    def card(self, qid: str) -> Card:
        return self.cards.get(qid, Card())

    def review(self, qid: str, rating: str) -> Card:
        self.cards[qid] = sm2(self.card(qid), rating, self.clock())
        return self.cards[qid]

    def due_first(self, items: Sequence[HasIdLevel], rng: random.Random | None = None) -> list[HasIdLevel]:
        """Overdue cards (most overdue first), then new cards with levels interleaved, then the rest by due date.

        Not-yet-due cards come last rather than being dropped, so a learner can always practise.
        """
        rng = rng or random.Random()
        now = self.clock()
        overdue, new, later = [], [], []
        for item in items:
            due = self.card(item.id).due_at()
            (new if due is None else overdue if due <= now else later).append((due, item))
        overdue.sort(key=lambda p: p[0])
        later.sort(key=lambda p: p[0])
        return [i for _, i in overdue] + _mix_levels([i for _, i in new], rng) + [i for _, i in later]

    def to_dict(self) -> dict:
        return {"version": 1, "algorithm": "SM-2", "cards": {k: asdict(v) for k, v in sorted(self.cards.items())}}

    @classmethod
    def from_dict(cls, d: dict, clock: Clock = utc_now) -> "Schedule":
        if not isinstance(d, dict) or not isinstance(d.get("cards", {}), dict):
            raise ValueError("not a minillm quiz schedule (expected {'cards': {...}})")
        return cls({k: Card.from_dict(v) for k, v in d.get("cards", {}).items()}, clock)


def _mix_levels(items: Iterable[HasIdLevel], rng: random.Random) -> list[HasIdLevel]:
    """Shuffle within each level, then deal round-robin across levels so a round never stays on one level."""
    groups: dict[str, list[HasIdLevel]] = {}
    for item in items:
        groups.setdefault(item.level, []).append(item)
    order = list(groups)
    rng.shuffle(order)
    for g in groups.values():
        rng.shuffle(g)
    out: list[HasIdLevel] = []
    while any(groups.values()):
        for level in order:
            if groups[level]:
                out.append(groups[level].pop())
    return out
