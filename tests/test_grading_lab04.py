"""lab04 checkers, graded both ways: minillm's own Scheduler passes the property suites; handed in as an answer (or
inherited) it is refused, and plausible wrong implementations of each policy step fail with a useful message.

Learner-style classes are defined here, outside the minillm package, the way an answer cell defines them."""
import functools

import pytest

from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import SequenceStatus
from minillm.grading import lab04 as L
from minillm.grading.lab04 import TASKS, check_lab04_1, check_lab04_2, check_lab04_3
from grading_helpers import rejected

CHECKERS = {1: check_lab04_1, 2: check_lab04_2, 3: check_lab04_3}
METHOD = {1: "schedule_running", 2: "admit_waiting", 3: "preempt"}
HAND_PICKED = ("CHUNKING", "DECODE_PLUS_CHUNK", "TINY_BUDGET", "PRESSURE", "PRESSURE_CHUNKED", "ONE_AT_A_TIME",
               "HEAD_BLOCKS", "SHARED_PREFIX", "SHARED_PREFIX_TIGHT", "FORKED_PRESSURE", "FORKS_FILL_SEATS")


def learner(name, **methods):
    """A class the way a learner writes it: a Scheduler subclass defined outside minillm."""
    return type(name, (Scheduler,), {"__module__": "__main__", **methods})


# ---------------------------------------------------------------- minillm's scheduler, the oracle, the cases

@pytest.mark.parametrize("task", [1, 2, 3])
def test_minillm_scheduler_passes(task):
    TASKS[f"lab04_{task}"].verify(Scheduler)


@pytest.mark.parametrize("name", HAND_PICKED)
def test_oracle_agrees_with_minillm_scheduler_step_by_step(name):
    """run_case compares every step of minillm's Scheduler with fcfs_step (it raises at the first difference)."""
    steps = L.run_case(Scheduler, getattr(L, name))
    assert steps and all(s.batch for s in steps)


def test_hand_picked_cases_exercise_what_they_claim():
    def trace(name):
        return L.run_case(Scheduler, getattr(L, name))

    def ran(step):
        return {(s.request_id, s.index): n for s, _, n in step.batch}
    assert any(s.preempted for s in trace("PRESSURE")) and any(s.preempted for s in trace("PRESSURE_CHUNKED"))
    chunking = trace("CHUNKING")
    assert all(n <= 8 for s in chunking for _, _, n in s.batch) and len(chunking) >= 5
    assert any(sorted(ran(s).values()) == [1, 7] for s in trace("DECODE_PLUS_CHUNK"))
    # HEAD_BLOCKS: '1' does not fit at first; '2' (which would) waits behind it
    first = {r: next(k for k, s in enumerate(trace("HEAD_BLOCKS")) if (r, 0) in ran(s)) for r in "012"}
    assert 1 < first["1"] <= first["2"], first
    assert any(start > 0 for s in trace("SHARED_PREFIX")[1:] for seq, start, _ in s.batch if seq.request_id != "0")
    forked = trace("FORKED_PRESSURE")
    victims = [v for s in forked for v in s.preempted]
    assert sum(v.index > 0 for v in victims) >= 2, victims               # forked samples are preempted ...
    assert any(seq.index > 0 and start == 0 for s in forked for seq, start, _ in s.batch)   # ... and recompute
    seats = trace("FORKS_FILL_SEATS")
    assert max(len(s.batch) for s in seats) == 3
    assert [k for k, s in enumerate(seats) if ("1", 0) in ran(s)][0] > 3   # '1' arrived at step 2 and waited


def test_oracle_leaves_the_engine_alone():
    """fcfs_step works on a deep copy of the block manager and on copied queue entries."""
    import copy

    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling.params import SamplingParams
    from minillm.testing import tiny_model
    engine = LLMEngine.from_model(tiny_model(), None, block_size=4, num_blocks=6, max_num_seqs=4,
                                  max_num_batched_tokens=16, attention_backend="torch")
    for i in range(3):
        engine.add_request(list(range(3 + i, 13 + i)), SamplingParams(temperature=0, max_tokens=8), request_id=str(i))
    engine.step()
    sched, bm = engine.scheduler, engine.block_manager
    before = (bm.num_free_blocks, {s.seq_id: bm.block_table(s.seq_id) for s in sched.running},
              [s.num_computed_tokens for s in sched.running], len(sched.waiting))
    items = [[L.Item(s, s.seq_id, tuple(s.token_ids), s.num_computed_tokens) for s in q]
             for q in (sched.running, sched.waiting)]
    L.fcfs_step(copy.deepcopy(bm), *items, 16, 4)
    assert before == (bm.num_free_blocks, {s.seq_id: bm.block_table(s.seq_id) for s in sched.running},
                      [s.num_computed_tokens for s in sched.running], len(sched.waiting))


# ---------------------------------------------------------------- what check refuses outright

@pytest.mark.parametrize("task", [1, 2, 3])
def test_rejects_minillm_scheduler_and_inherited_methods(task):
    rejected(CHECKERS[task], Scheduler, "minillm")
    rejected(CHECKERS[task], learner("Lazy"), "does not define")
    raw = vars(Scheduler)[METHOD[task]]
    rejected(CHECKERS[task], learner("Alias", **{METHOD[task]: raw}), "minillm's own implementation")

    def forward(self, *args):
        return raw(self, *args)
    rejected(CHECKERS[task], learner("Forward", **{METHOD[task]: forward}), "minillm's own implementation")


def test_rejects_the_oracle_under_learner_code():
    import copy

    def schedule_running(self, out, budget):
        L.fcfs_step(copy.deepcopy(self.block_manager), [], [], budget, 1)
        _running(self, out, budget)
    rejected(check_lab04_1, learner("Peek", schedule_running=schedule_running), "grader's reference answer")


@pytest.mark.slow    # ~4-7 s: the quick subset stays under 3 minutes
def test_instances_are_accepted():
    from minillm.config import SchedulerConfig
    from minillm.kv.block_manager import BlockManager
    mine = learner("Mine", preempt=functools.partialmethod(_preempt))
    check_lab04_3(mine(SchedulerConfig(), BlockManager(4, 4)))


def test_not_a_scheduler_and_not_implemented():
    rejected(check_lab04_1, int, "subclass of minillm's Scheduler")

    def todo(self, *a):
        raise NotImplementedError()
    for task, checker in CHECKERS.items():
        rejected(checker, learner("Todo", **{METHOD[task]: todo}), "not implemented yet")


def test_endless_loop_is_reported():
    def spin(self, out, budget):
        while True:
            pass
    with pytest.raises(AssertionError, match="endless loop"):
        L.verify_lab04_1(learner("Spin", schedule_running=spin), time_limit=1)


# ---------------------------------------------------------------- lab04_1: running sequences

def _running(self, out, budget, *, cap=True, chunk=True, victim=-1, preempt=True, skip_when_short=False,
             list_victims=True, only_when_empty=False, stop_on_self=True, copies=True, same_request_stops=False,
             reserve=True):
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
            if (v.request_id == seq.request_id) if same_request_stops else (v is seq and stop_on_self):
                return
        pairs = bm.append_slots(seq.seq_id, seq.num_computed_tokens + n) if reserve else []
        if copies:
            out.block_copies += pairs
        out.scheduled.append((seq, n))
        budget -= n
        i += 1


RUNNING_WRONG = {
    "ignores_budget": (dict(cap=False), "more than max_num_batched_tokens"),
    "never_chunks": (dict(chunk=False), "never skip it"),
    "preempts_oldest": (dict(victim=0), "NEWEST"),
    "never_preempts": (dict(preempt=False), "NoFreeBlocksError"),
    "waits_instead_of_preempting": (dict(skip_when_short=True), "instead of waiting"),
    "victims_not_listed": (dict(list_victims=False), "out.preempted"),
    "preempts_only_when_pool_empty": (dict(only_when_empty=True), "preempt only while"),
    "schedules_its_own_victim": (dict(stop_on_self=False), "victim is seq itself"),
    "reserves_no_slots": (dict(reserve=False), "reserve the slots"),
    # only with n > 1: forked samples share blocks (copy-on-write) and a request has several sequences
    "drops_block_copies": (dict(copies=False), "copy-on-write"),
    "stops_when_a_sibling_is_preempted": (dict(same_request_stops=True), "victim is seq"),
}


@pytest.mark.parametrize("name", RUNNING_WRONG)
def test_lab04_1_wrong_implementations_fail(name):
    knobs, diagnosis = RUNNING_WRONG[name]
    rejected(check_lab04_1, learner(name, schedule_running=functools.partialmethod(_running, **knobs)),
             diagnosis, "Smallest failing example", "Hint")


def test_lab04_1_n_gt_1_mistakes_show_only_with_forks():
    """Without n > 1 the two fork-only mistakes behave exactly like the policy."""
    for name in ("drops_block_copies", "stops_when_a_sibling_is_preempted"):
        cls = learner(name, schedule_running=functools.partialmethod(_running, **RUNNING_WRONG[name][0]))
        for case in ("PRESSURE", "PRESSURE_CHUNKED", "SHARED_PREFIX"):
            L.run_case(cls, getattr(L, case))


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab04_1_correct_learner_code_passes():
    check_lab04_1(learner("Mine", schedule_running=functools.partialmethod(_running)))

    def schedule_running(self, out, budget):        # written differently: a for loop over a snapshot
        bm = self.block_manager
        for seq in list(self.running):
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                break
            end = seq.num_computed_tokens + min(budget, seq.num_tokens - seq.num_computed_tokens)
            while bm.num_free_blocks < bm.num_blocks_needed(seq.seq_id, end):
                newest = self.running[-1]
                self.preempt(newest)
                out.preempted.append(newest)
                if newest is seq:
                    return
            out.block_copies.extend(bm.append_slots(seq.seq_id, end))
            out.scheduled.append((seq, end - seq.num_computed_tokens))
            budget -= end - seq.num_computed_tokens
    check_lab04_1(learner("Mine2", schedule_running=schedule_running))


def test_lab04_1_lying_token_count_is_refused():
    class Count(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

    def schedule_running(self, out, budget):
        _running(self, out, budget)
        out.scheduled[:] = [(s, Count(n)) for s, n in out.scheduled]
    rejected(check_lab04_1, learner("Liar", schedule_running=schedule_running), "must be an int")


# ---------------------------------------------------------------- lab04_2: admission

def _admit(self, out, budget, *, check_blocks=True, max_seqs=True, overtake=False, chunk=True, prefix=True,
           set_computed=True, cap=True, count_requests=False, allocate=True, join=True, blocks="to_admit"):
    bm = self.block_manager
    for seq in list(self.waiting):
        seats = len({s.request_id for s in self.running}) if count_requests else len(self.running)
        if budget <= 0 or (max_seqs and seats >= self.config.max_num_seqs):
            return
        cached = bm.peek_prefix(seq.token_ids) if prefix else 0
        n = min(seq.num_tokens - cached, budget) if cap else seq.num_tokens - cached
        ok = chunk or n == seq.num_tokens - cached
        if ok and check_blocks:
            need = {"to_admit": lambda: bm.blocks_to_admit(seq.token_ids, cached + n),
                    "chunk_only": lambda: bm.blocks_to_admit(seq.token_ids, n),               # forgets the offset
                    "as_if_new": lambda: bm.num_blocks_needed(seq.seq_id, cached + n)}[blocks]()  # ignores hits
            ok = need <= bm.num_free_blocks
        if not ok:
            if overtake:
                continue
            return
        self.waiting.remove(seq)
        got = bm.allocate_prompt(seq.seq_id, seq.token_ids) if allocate else 0
        if set_computed:
            seq.num_computed_tokens = got
        out.block_copies += bm.append_slots(seq.seq_id, seq.num_computed_tokens + n)
        seq.status = SequenceStatus.RUNNING
        if join:
            self.running.append(seq)
        out.scheduled.append((seq, n))
        budget -= n


ADMIT_WRONG = {
    "no_free_block_check": (dict(check_blocks=False), "NoFreeBlocksError"),
    "ignores_max_num_seqs": (dict(max_seqs=False), "max_num_seqs"),
    "overtakes": (dict(overtake=True), "no overtaking"),
    "never_chunks": (dict(chunk=False), "chunked prefill"),
    "ignores_prefix_cache": (dict(prefix=False), "peek_prefix"),
    "forgets_cached_tokens": (dict(set_computed=False), "what it returns"),
    "ignores_budget": (dict(cap=False), "more than max_num_batched_tokens"),
    "never_allocates": (dict(allocate=False), "bm.allocate_prompt"),
    "never_joins_running": (dict(join=False), "not in self.running"),
    # only with n > 1: the samples of one request are several sequences, each taking a seat
    "counts_requests_not_sequences": (dict(count_requests=True), "count sequences, not requests"),
    # only with a cached prefix in a tight pool (SHARED_PREFIX_TIGHT): the blocks a waiting prompt needs
    "blocks_for_the_chunk_from_0": (dict(blocks="chunk_only"), "NoFreeBlocksError"),
    "blocks_as_if_nothing_cached": (dict(blocks="as_if_new"), "admit it"),
}


@pytest.mark.parametrize("name", ADMIT_WRONG)
def test_lab04_2_wrong_implementations_fail(name):
    knobs, diagnosis = ADMIT_WRONG[name]
    rejected(check_lab04_2, learner(name, admit_waiting=functools.partialmethod(_admit, **knobs)),
             diagnosis, "Smallest failing example", "Hint")


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab04_2_correct_learner_code_passes():
    check_lab04_2(learner("Mine", admit_waiting=functools.partialmethod(_admit)))

    def admit_waiting(self, out, budget):          # written differently: one admission per loop turn, early exits
        bm = self.block_manager
        while True:
            if not self.waiting or budget < 1 or len(self.running) >= self.config.max_num_seqs:
                break
            head = self.waiting[0]
            hit = bm.peek_prefix(head.token_ids)
            take = min(budget, head.num_tokens - hit)
            if bm.num_free_blocks < bm.blocks_to_admit(head.token_ids, hit + take):
                break
            seq = self.waiting.popleft()
            seq.num_computed_tokens = bm.allocate_prompt(seq.seq_id, seq.token_ids)
            out.block_copies.extend(bm.append_slots(seq.seq_id, hit + take))
            seq.status = SequenceStatus.RUNNING
            self.running += [seq]
            out.scheduled += [(seq, take)]
            budget = budget - take
    check_lab04_2(learner("Mine2", admit_waiting=admit_waiting))


# ---------------------------------------------------------------- lab04_3: preemption by recompute

def _preempt(self, seq, *, reset=True, free=True, head=True, remove=True, status=True, count=True, by_request=False,
             pop_newest=False):
    if pop_newest:
        self.running.pop()
    elif by_request:
        self.running[:] = [s for s in self.running if s.request_id != seq.request_id]
    elif remove:
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
    "keeps_num_computed_tokens": (dict(reset=False), "reset it to 0"),
    "keeps_blocks": (dict(free=False), "free them"),
    "back_of_the_queue": (dict(head=False), "HEAD"),
    "stays_running": (dict(remove=False), "still in self.running"),
    "status_unchanged": (dict(status=False), "WAITING"),
    "not_counted": (dict(count=False), "num_preemptions"),
    # only with n > 1: removing by request id takes the victim's sibling samples out of running too
    "removes_by_request_id": (dict(by_request=True), "not by request_id"),
    # only when preempt is given a sequence other than the newest: the policy never does, the contract does
    "pops_the_newest_whatever_seq": (dict(pop_newest=True), "whichever it is"),
}


@pytest.mark.parametrize("name", PREEMPT_WRONG)
def test_lab04_3_wrong_implementations_fail(name):
    knobs, diagnosis = PREEMPT_WRONG[name]
    rejected(check_lab04_3, learner(name, preempt=functools.partialmethod(_preempt, **knobs)),
             diagnosis, "Smallest failing example", "Hint")


@pytest.mark.slow      # seconds: the checker's full run on correct code; the wrong answers stay fast
def test_lab04_3_correct_learner_code_passes():
    check_lab04_3(learner("Mine", preempt=functools.partialmethod(_preempt)))

    def preempt(self, seq):                        # written differently
        self.waiting.insert(0, seq)
        self.running = [s for s in self.running if s is not seq]
        seq.metrics.num_preemptions = seq.metrics.num_preemptions + 1
        seq.num_computed_tokens, seq.status = 0, SequenceStatus.WAITING
        self.block_manager.free(seq.seq_id)
    check_lab04_3(learner("Mine2", preempt=preempt))
