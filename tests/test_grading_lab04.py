"""lab04 checkers, graded both ways: minillm's own scheduler methods pass (wrapped in a learner-style subclass),
the very methods are rejected, and plausible wrong implementations of each task fail with a useful message."""
import functools
import types

import pytest

from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import SequenceStatus
from minillm.grading import lab04 as L
from minillm.grading.lab04 import check_lab04_1, check_lab04_2, check_lab04_3

CHECKERS = {1: check_lab04_1, 2: check_lab04_2, 3: check_lab04_3}


def rejected(checker, cls, *needles):
    with pytest.raises(AssertionError) as e:
        checker(cls)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    assert len(msg.splitlines()) < 12, msg
    return msg


def learner(name, **methods):
    """A class the way a learner writes it: a Scheduler subclass defined outside minillm."""
    return type(name, (Scheduler,), {"__module__": "__main__", **methods})


class Wrapped(Scheduler):
    """minillm's own policy, reached through thin wrappers (the learner's code path)."""
    def _schedule_running(self, out, budget):
        return Scheduler._schedule_running(self, out, budget)

    def _admit_waiting(self, out, budget):
        return Scheduler._admit_waiting(self, out, budget)

    def preempt(self, seq):
        return Scheduler.preempt(self, seq)


# ---------------------------------------------------------------- the reference and the cases

@pytest.mark.parametrize("task", [1, 2, 3])
def test_minillm_scheduler_passes(task):
    CHECKERS[task](Wrapped)


def test_reference_scheduler_traces_equal_minillm_scheduler():
    """The grading module's policy is minillm's policy: same decisions step by step on every hand-picked case."""
    for case in (L.CHUNKING, L.DECODE_PLUS_CHUNK, L.TINY_BUDGET, L.PRESSURE, L.PRESSURE_CHUNKED, L.ONE_AT_A_TIME,
                 L.HEAD_BLOCKS, L.SHARED_PREFIX):
        ref, own = L.reference_run(case), L.run_case(Scheduler, case)
        assert own.error is None, own.error
        assert [(s.scheduled, s.preempted) for s in own.trace] == [(s.scheduled, s.preempted) for s in ref.trace]
        assert own.outputs == ref.outputs


def test_hand_picked_cases_exercise_what_they_claim():
    trace = lambda c: L.reference_run(c).trace  # noqa: E731
    assert any(s.preempted for s in trace(L.PRESSURE)) and any(s.preempted for s in trace(L.PRESSURE_CHUNKED))
    assert all(n <= 8 for s in trace(L.CHUNKING) for _, n in s.scheduled) and len(trace(L.CHUNKING)) >= 5
    assert any(sorted(n for _, n in s.scheduled) == [1, 7] for s in trace(L.DECODE_PLUS_CHUNK))
    # HEAD_BLOCKS: '1' does not fit at first; '2' (which would) waits behind it
    first = {r: next(k for k, s in enumerate(trace(L.HEAD_BLOCKS)) if r in dict(s.scheduled)) for r in "012"}
    assert 1 < first["1"] <= first["2"], first
    rr = L.run_case(Scheduler, L.SHARED_PREFIX)
    assert rr.error is None
    assert any(n < 21 for s in rr.trace[1:] for r, n in s.scheduled if r in "12")   # prefix-cache hits


@pytest.mark.parametrize("task", [1, 2, 3])
def test_rejects_minillm_methods_themselves(task):
    rejected(CHECKERS[task], Scheduler, "does not define")
    rejected(CHECKERS[task], learner("Lazy"), "does not define")
    method = L.TASK_METHOD[task]
    same = learner("Alias", **{method: getattr(Scheduler, method)})
    rejected(CHECKERS[task], same, "minillm's own implementation")
    fn = getattr(Scheduler, method)
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    rejected(CHECKERS[task], learner("Copy", **{method: copy}), "minillm's own implementation")
    rejected(CHECKERS[task], learner("Ref", **{method: getattr(L.ReferenceScheduler, method)}),
             "minillm's own implementation")


def test_not_a_scheduler_and_not_implemented():
    rejected(check_lab04_1, int, "subclass of minillm's Scheduler")

    def todo(self, *a):
        raise NotImplementedError()
    for task, checker in CHECKERS.items():
        rejected(checker, learner("Todo", **{L.TASK_METHOD[task]: todo}), "not implemented yet")


def test_instances_are_accepted():
    from minillm.config import SchedulerConfig
    from minillm.kv.block_manager import BlockManager
    check_lab04_3(Wrapped(SchedulerConfig(), BlockManager(4, 4)))


# ---------------------------------------------------------------- lab04_1: running sequences

def _running(self, out, budget, *, cap=True, chunk=True, victim=-1, preempt=True, skip_when_short=False,
             list_victims=True, only_when_empty=False, stop_on_self=True):
    bm = self.block_manager
    i = 0
    while i < len(self.running) and budget > 0:
        seq = self.running[i]
        n = min(seq.num_uncomputed, budget) if cap else seq.num_uncomputed
        if not chunk and n < seq.num_uncomputed:
            i += 1
            continue
        if skip_when_short and bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks:
            i += 1          # wait for blocks instead of preempting
            continue
        def short():
            if only_when_empty:
                return bm.num_free_blocks == 0
            return bm.num_blocks_needed(seq.seq_id, seq.num_computed_tokens + n) > bm.num_free_blocks
        while preempt and short():
            v = self.running[victim]
            self.preempt(v)
            if list_victims:
                out.preempted.append(v)
            if v is seq and stop_on_self:
                return
        out.block_copies += bm.append_slots(seq.seq_id, seq.num_computed_tokens + n)
        out.scheduled.append((seq, n))
        budget -= n
        i += 1


RUNNING_WRONG = {
    "ignores_budget": (functools.partialmethod(_running, cap=False), "more than max_num_batched_tokens"),
    "never_chunks": (functools.partialmethod(_running, chunk=False), "never skip it"),
    "preempts_oldest": (functools.partialmethod(_running, victim=0), "NEWEST"),
    "never_preempts": (functools.partialmethod(_running, preempt=False), "NoFreeBlocksError"),
    "waits_instead_of_preempting": (functools.partialmethod(_running, skip_when_short=True), "instead of waiting"),
    "victims_not_listed": (functools.partialmethod(_running, list_victims=False), "out.preempted"),
    "preempts_only_when_pool_empty": (functools.partialmethod(_running, only_when_empty=True), "NoFreeBlocksError"),
    "schedules_its_own_victim": (functools.partialmethod(_running, stop_on_self=False), "victim is seq itself"),
}


@pytest.mark.parametrize("name", RUNNING_WRONG)
def test_lab04_1_wrong_implementations_fail(name):
    fn, diagnosis = RUNNING_WRONG[name]
    rejected(check_lab04_1, learner(name, _schedule_running=fn), diagnosis, "Smallest failing example", "Hint")


def test_lab04_1_correct_learner_code_passes():
    check_lab04_1(learner("Mine", _schedule_running=functools.partialmethod(_running)))


# ---------------------------------------------------------------- lab04_2: admission

def _admit(self, out, budget, *, check_blocks=True, max_seqs=True, overtake=False, chunk=True, prefix=True,
           set_computed=True, cap=True):
    bm = self.block_manager
    for seq in list(self.waiting):
        if budget <= 0 or (max_seqs and len(self.running) >= self.config.max_num_seqs):
            return
        cached = bm.peek_prefix(seq.token_ids) if prefix else 0
        n = min(seq.num_tokens - cached, budget) if cap else seq.num_tokens - cached
        ok = chunk or n == seq.num_tokens - cached
        if ok and check_blocks:
            ok = bm.blocks_to_admit(seq.token_ids, cached + n) <= bm.num_free_blocks
        if not ok:
            if overtake:
                continue
            return
        self.waiting.remove(seq)
        got = bm.allocate_prompt(seq.seq_id, seq.token_ids)
        if set_computed:
            seq.num_computed_tokens = got
        out.block_copies += bm.append_slots(seq.seq_id, seq.num_computed_tokens + n)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append((seq, n))
        budget -= n


ADMIT_WRONG = {
    "no_free_block_check": (functools.partialmethod(_admit, check_blocks=False), "NoFreeBlocksError"),
    "ignores_max_num_seqs": (functools.partialmethod(_admit, max_seqs=False), "max_num_seqs"),
    "overtakes": (functools.partialmethod(_admit, overtake=True), "no overtaking"),
    "never_chunks": (functools.partialmethod(_admit, chunk=False), "chunked prefill"),
    "ignores_prefix_cache": (functools.partialmethod(_admit, prefix=False), "peek_prefix"),
    "forgets_cached_tokens": (functools.partialmethod(_admit, set_computed=False), "what it returns"),
    "ignores_budget": (functools.partialmethod(_admit, cap=False), "more than max_num_batched_tokens"),
}


@pytest.mark.parametrize("name", ADMIT_WRONG)
def test_lab04_2_wrong_implementations_fail(name):
    fn, diagnosis = ADMIT_WRONG[name]
    rejected(check_lab04_2, learner(name, _admit_waiting=fn), diagnosis, "Smallest failing example", "Hint")


def test_lab04_2_correct_learner_code_passes():
    check_lab04_2(learner("Mine", _admit_waiting=functools.partialmethod(_admit)))


# ---------------------------------------------------------------- lab04_3: preemption by recompute

def _preempt(self, seq, *, reset=True, free=True, head=True, remove=True, status=True, count=True):
    if remove:
        self.running.remove(seq)
    if free:
        self.block_manager.free(seq.seq_id)
    if status:
        seq.status = SequenceStatus.WAITING
    if reset:
        seq.num_computed_tokens = 0
    if count:
        seq.metrics.num_preemptions += 1
    (self.waiting.appendleft if head else self.waiting.append)(seq)


PREEMPT_WRONG = {
    "keeps_num_computed_tokens": (functools.partialmethod(_preempt, reset=False), "reset it to 0"),
    "keeps_blocks": (functools.partialmethod(_preempt, free=False), "free them"),
    "back_of_the_queue": (functools.partialmethod(_preempt, head=False), "HEAD"),
    "stays_running": (functools.partialmethod(_preempt, remove=False), "still in self.running"),
    "status_unchanged": (functools.partialmethod(_preempt, status=False), "WAITING"),
    "not_counted": (functools.partialmethod(_preempt, count=False), "num_preemptions"),
}


@pytest.mark.parametrize("name", PREEMPT_WRONG)
def test_lab04_3_wrong_implementations_fail(name):
    fn, diagnosis = PREEMPT_WRONG[name]
    rejected(check_lab04_3, learner(name, preempt=fn), diagnosis, "Smallest failing example", "Hint")


def test_lab04_3_correct_learner_code_passes():
    check_lab04_3(learner("Mine", preempt=functools.partialmethod(_preempt)))


def test_endless_loop_is_reported():
    def spin(self, out, budget):
        while True:
            pass
    old = L.TIME_LIMIT_S
    L.TIME_LIMIT_S = 2
    try:
        rejected(check_lab04_1, learner("Spin", _schedule_running=spin), "endless loop")
    finally:
        L.TIME_LIMIT_S = old
