"""Grading integrity of the in-notebook checks (feedback): for every checker of every lab, the ways an answer could
fool it are tried and refused, and the blank starters read "not implemented yet". What a cell does to its kernel
(patching a grading module, torch, IPython) cannot be refused there; tests/test_grading_trusted.py shows each such
trick fail under trusted grading, the verdict `minillm grade` and nbgrader record.

The tasks come from each grading module's TASKS (their kind, minillm's implementation, the grader's oracle), the
blank starters and the graded cells from the released notebooks, so a new lab is covered the moment it exists:
  - blank starters: every graded cell, run after the released (untouched) answer cells, says "not implemented yet";
  - rebinding a checker's name: the graded cell imports it afresh;
  - lying results: an __eq__ that is always true, a tensor subclass whose __torch_function__ makes every
    comparison true, a number whose __float__ reads the expected value from the checker's frames;
  - delegation to minillm's own implementation (or the grader's oracle): the object itself, partial,
    partialmethod, a wrapper, a subclass that inherits or calls super(), a forwarding composition, a copy of its
    source;
  - graders and labs use no private name of an engine object.
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import linecache
import sys
import textwrap
import types
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from minillm.grading import core
from minillm.grading.core import GradingError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_notebooks as bn  # noqa: E402

LABS = bn.lab_ids(ROOT)
MODULES = {lab: importlib.import_module(f"minillm.grading.{lab}") for lab in LABS}
TASKS = {tid: task for m in MODULES.values() for tid, task in m.TASKS.items()}


def _lab(tid: str) -> str:
    return tid.split("_")[0]


# ---------------------------------------------------------------- a learner's namespace, like a notebook's

_counter = iter(range(10**6))


def learner_module() -> types.ModuleType:
    """A fresh module standing for a notebook's namespace: its code counts as the learner's (its file is not
    minillm's nor a library's)."""
    name = f"learner_answers_{next(_counter)}"
    mod = types.ModuleType(name)
    mod.__file__ = str(ROOT / "tests" / f"{name}.py")
    mod.__builtins__ = builtins
    sys.modules[name] = mod
    return mod


def run_cell(mod: types.ModuleType, source: str) -> None:
    """Run a cell the way IPython does: its own file name, its source registered with linecache (so that
    inspect.getsource finds functions defined in it, as the Triton and cross-process checks need)."""
    filename = mod.__file__[:-3] + f"_cell{next(_counter)}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), vars(mod))


def released(lab: str) -> tuple[list[str], list[str], dict[str, str]]:
    """(import lines of the read-only cells, answer cells, grade_id -> graded cell) of the released notebook."""
    nb = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    imports, answers, graded = [], [], {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code":
            continue
        if meta.get("grade"):
            graded[meta["grade_id"]] = cell.source
        elif meta.get("solution"):
            answers.append(cell.source)
        elif meta.get("locked"):
            tree = ast.parse(cell.source)
            imports += [ast.get_source_segment(cell.source, n) for n in tree.body
                        if isinstance(n, (ast.Import, ast.ImportFrom))]
    return imports, answers, graded


def blank_notebook(lab: str) -> tuple[types.ModuleType, dict[str, str]]:
    """A namespace after the released answer cells ran untouched (the starter), and the graded cells."""
    imports, answers, graded = released(lab)
    mod = learner_module()
    run_cell(mod, "\n".join(imports))
    for source in answers:
        run_cell(mod, source)
    return mod, graded


BLANKS: dict = {}


def blank(lab: str):
    if lab not in BLANKS:
        BLANKS[lab] = blank_notebook(lab)
    return BLANKS[lab]


def graded_fails(lab: str, tid: str, attack: str = "", expect: str = "not implemented yet") -> str:
    """Run an attack cell (if any) after the blank answer cells, then the graded cell: it must fail."""
    mod, graded = blank(lab)
    if attack:
        run_cell(mod, attack)
    with pytest.raises(GradingError) as e:
        run_cell(mod, graded[tid])
    assert expect in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------- blank starters and the graded cells

def test_every_graded_cell_has_a_task():
    for lab in LABS:
        _, _, graded = released(lab)
        assert sorted(graded) == sorted(t for t in TASKS if _lab(t) == lab), lab
        for tid, source in graded.items():
            assert source.strip() == f"from minillm.grading.{lab} import check_{tid}; check_{tid}" \
                                     f"({source.strip().rsplit('(', 1)[1]}", source


@pytest.mark.parametrize("tid", sorted(TASKS))
def test_blank_starter_reads_not_implemented_yet(tid):
    for _ in range(3):           # however often it is run: no example, and no hint (nothing to nudge yet)
        msg = graded_fails(_lab(tid), tid)
        assert "Smallest failing example" not in msg and "Hint" not in msg and len(msg.splitlines()) == 1, msg


# ---------------------------------------------------------------- rebinding and patching

@pytest.mark.parametrize("tid", sorted(TASKS))
def test_rebinding_the_checker_name_changes_nothing(tid):
    graded_fails(_lab(tid), tid, f"check_{tid} = lambda *args, **kwargs: None")


# ---------------------------------------------------------------- lying results

class AlwaysEqualInt(int):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


class AlwaysEqualFloat(float):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = float.__hash__


class FrameSnoop(float):
    """A number whose value is whatever the checker expects: it reads the reference from the caller's frames."""

    def __float__(self):
        f = sys._getframe(1)
        while f is not None:
            for name in ("ref", "want", "expected"):
                v = f.f_locals.get(name)
                if isinstance(v, (int, float)):
                    return float(v)
            f = f.f_back
        return 0.0


class AgreeableTensor(torch.Tensor):
    """Every comparison of this tensor comes out equal: allclose, equal, isclose, ==, the lot."""

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal, torch.Tensor.allclose, torch.Tensor.equal):
            return True
        if func in (torch.isclose, torch.Tensor.__eq__, torch.eq):
            return torch.ones((), dtype=torch.bool)
        return super().__torch_function__(func, types_, args, kwargs or {})


def agreeable(x: torch.Tensor) -> torch.Tensor:
    return x.as_subclass(AgreeableTensor)


def _liar_lab02_allocator():
    class Liar:
        def __init__(self, n):
            self.inner = [0] * n

        def allocate(self):
            return AlwaysEqualInt(0)

        def share(self, b):
            pass

        def free(self, b):
            pass

        def ref_count(self, b):
            return AlwaysEqualInt(0)

        @property
        def num_free_blocks(self):
            return AlwaysEqualInt(0)
    return Liar


def _liar_lab05_evictor():
    class Liar:
        def __init__(self):
            self.blocks = []

        def add(self, b):
            self.blocks.append(b)

        def remove(self, b):
            pass

        def pop_lru(self):
            return AlwaysEqualInt(0)

        def clear(self):
            return [AlwaysEqualInt(0)]

        def __len__(self):
            return len(self.blocks)

        def __iter__(self):
            return iter([AlwaysEqualInt(0)] * len(self.blocks))
    return Liar


def _liar_lab02_manager():
    from minillm.kv.block_manager import BlockManager

    class Liar(BlockManager):
        def num_blocks_needed(self, seq_id, num_tokens):
            return AlwaysEqualInt(0)

        def append_slots(self, seq_id, num_tokens):
            return []

        def fork(self, parent_seq_id, child_seq_id):
            pass

        def free(self, seq_id):
            pass
    return Liar


def _liar_lab04(task):
    from minillm.engine.scheduler import Scheduler
    from minillm.engine.sequence import SequenceStatus

    class Liar(Scheduler):
        def schedule_running(self, out, budget):
            for seq in list(self.running)[:budget]:
                n = min(seq.num_uncomputed, 1)
                out.block_copies += self.block_manager.append_slots(seq.seq_id, seq.num_computed_tokens + n)
                out.scheduled.append((seq, AlwaysEqualInt(n)))

        def admit_waiting(self, out, budget):
            if self.waiting and not self.running:
                seq = self.waiting.popleft()
                seq.num_computed_tokens = self.block_manager.allocate_prompt(seq.seq_id, seq.token_ids)
                out.block_copies += self.block_manager.append_slots(seq.seq_id, seq.num_tokens)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append((seq, AlwaysEqualInt(seq.num_tokens - seq.num_computed_tokens)))

        def preempt(self, seq):
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = AlwaysEqualInt(0)
            seq.metrics.num_preemptions = AlwaysEqualInt(seq.metrics.num_preemptions + 1)
            self.waiting.appendleft(seq)
    return Liar


def _liar_softmax(m, l, acc, scores, values):
    return agreeable(m), agreeable(l), agreeable(acc)


class AgreeableArray(np.ndarray):
    """A numpy array whose comparisons all come out equal."""

    def __eq__(self, other):
        return np.ones(np.broadcast(self, other).shape, dtype=bool)

    def __ne__(self, other):
        return np.zeros(np.broadcast(self, other).shape, dtype=bool)

    __hash__ = None


def _liar_lab10_dfa(nfa, start, accept):
    from minillm.structured.automata import DFA
    return DFA(np.full((1, 256), -1, dtype=np.int32).view(AgreeableArray), np.ones(1, dtype=bool), AlwaysEqualInt(0))


def _liar_lab10_index(dfa, vocab, eos_token_ids):
    from minillm.structured.token_index import TokenIndex
    empty = [np.zeros(0, dtype=np.int64).view(AgreeableArray) for _ in range(dfa.num_states)]
    return TokenIndex(dfa, empty, list(empty), tuple(eos_token_ids), AlwaysEqualInt(len(vocab.token_bytes)))


class AlwaysEqualList(list):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = None


def _liar_lab09_rules():
    class Liar:
        def column_forward(self, x, weight, bias, comm):
            return agreeable(torch.zeros(x.shape[0], weight.shape[0]))

        def row_forward(self, x, weight, bias, comm):
            return agreeable(torch.zeros(x.shape[0], weight.shape[0]))
    return Liar


def _liar_lab09_bytes():
    class Liar:
        def tp_bytes_per_token(self, hidden_size, num_layers, dtype_bytes):
            return FrameSnoop(0)

        def pp_bytes_per_token(self, hidden_size, pp, dtype_bytes):
            return FrameSnoop(0)
    return Liar


def _liar_lab08_quantizer(kind):
    from minillm.quant.formats import QuantizedWeight

    def quantize(w, group_size=None):
        n, k = w.shape
        g = k if group_size is None else group_size
        q = torch.zeros(n, k, dtype=torch.int8) if kind == "int8" else torch.zeros(n, k // 2, dtype=torch.uint8)
        mins = None if kind == "int8" else agreeable(torch.zeros(n, k // g, dtype=torch.float16))
        return QuantizedWeight(kind, agreeable(q), agreeable(torch.zeros(n, k // g, dtype=torch.float16)), mins, g)
    return (lambda w: quantize(w)) if kind == "int8" else quantize


def _liar_lab11_metrics(trace):
    from minillm.bench.serving_metrics import TraceMetrics
    return TraceMetrics(AlwaysEqualFloat(0), None, AlwaysEqualList(), AlwaysEqualFloat(0))


def _liar_lab11_admission():
    class Liar:
        def __init__(self, max_waiting_requests, max_waiting_tokens):
            pass

        def admit(self, waiting_requests, waiting_tokens, prompt_tokens):
            return AlwaysEqualInt(1)
    return Liar


def _liar_lab12_router():
    class Liar:
        def __init__(self, num_replicas, block_size, prefix_blocks, epsilon):
            pass

        def route(self, request, replicas):
            return AlwaysEqualInt(0)
    return Liar


LIARS = {
    "lab00_1": lambda: (lambda t, i, o, b: (AlwaysEqualFloat(0), AlwaysEqualFloat(0))),
    "lab00_2": lambda: (lambda cfg, t, n, b: (FrameSnoop(0), FrameSnoop(0))),
    "lab00_3": lambda: (lambda f, b, p, w: FrameSnoop(0)),
    "lab01_1": lambda: (lambda q, k, v, scale: agreeable(torch.zeros_like(q))),
    "lab01_2": lambda: (lambda cfg, b, s, d: AlwaysEqualInt(0)),
    "lab01_3": lambda: (lambda cfg, m, w, s, d: FrameSnoop(0)),
    "lab02_1": lambda: (lambda table, start, end, bs: [AlwaysEqualInt(0)] * (end - start)),
    "lab02_2": _liar_lab02_allocator,
    "lab02_3": _liar_lab02_manager,
    "lab03_1": lambda: (lambda cache, table, n: agreeable(torch.zeros(n, *cache.shape[2:], dtype=cache.dtype))),
    "lab03_2": lambda: _liar_softmax,
    "lab04_1": lambda: _liar_lab04(1),
    "lab04_2": lambda: _liar_lab04(2),
    "lab04_3": lambda: _liar_lab04(3),
    "lab05_1": lambda: (lambda parent, tokens: AlwaysEqualInt(2**100)),
    "lab05_2": lambda: (lambda token_ids, bs, cache, hash_fn: [AlwaysEqualInt(0)]),
    "lab05_3": _liar_lab05_evictor,
    "lab06_1": lambda: (lambda logits, temperature, top_k, top_p, min_p: agreeable(logits.clone())),
    "lab06_2": lambda: (lambda probs, generators: agreeable(probs.argmax(-1))),
    "lab07_1": lambda: (lambda target_probs, drafts, draft_probs, generator: list(drafts) + [AlwaysEqualInt(0)]),
    "lab07_2": lambda: (lambda token_ids, k, min_n, max_n: [AlwaysEqualInt(0)]),
    "lab08_1": lambda: _liar_lab08_quantizer("int8"),
    "lab08_2": lambda: _liar_lab08_quantizer("int4"),
    "lab08_3": lambda: (lambda qw: agreeable(torch.zeros(qw.shape))),
    "lab08_4": lambda: (lambda x, qw: agreeable(torch.zeros(*x.shape[:-1], qw.shape[0], dtype=x.dtype))),
    "lab09_1": lambda: (lambda num_units, unit_size, rank, world_size: AlwaysEqualList()),
    "lab09_2": lambda: (lambda input_size, rank, world_size: AlwaysEqualList()),
    "lab09_3": _liar_lab09_rules,
    "lab09_4": _liar_lab09_bytes,
    "lab10_1": lambda: (lambda node, nfa: (AlwaysEqualInt(nfa.state()), AlwaysEqualInt(nfa.state()))),
    "lab10_2": lambda: _liar_lab10_dfa,
    "lab10_3": lambda: _liar_lab10_index,
    "lab11_1": lambda: (lambda values, q: AlwaysEqualFloat(0)),
    "lab11_2": lambda: _liar_lab11_metrics,
    "lab11_3": lambda: (lambda traces, slos, duration: AlwaysEqualFloat(0)),
    "lab11_4": _liar_lab11_admission,
    "lab12_1": lambda: (lambda traces: {k: FrameSnoop(0) for k in ("o_step", "o_seq", "c_token", "c_pair", "m_step",
                                                                    "m_kv")}),
    "lab12_2": _liar_lab12_router,
}
# No liar for the kernel (lab03_3): it returns nothing, its results are read from buffers the checker owns.
NO_RESULT_TO_LIE_WITH = {"lab03_3"}


def test_every_task_has_a_liar():
    assert set(TASKS) - NO_RESULT_TO_LIE_WITH <= set(LIARS), sorted(set(TASKS) - set(LIARS))


@pytest.mark.parametrize("tid", sorted(set(LIARS) & set(TASKS)))
def test_lying_results_are_refused(tid):
    with pytest.raises(GradingError) as e:
        TASKS[tid].check(LIARS[tid]())
    msg = str(e.value)
    assert "must be" in msg or "got a" in msg, msg


# ---------------------------------------------------------------- delegation to minillm (or the oracle)

def _copy_source(obj, mod: types.ModuleType):
    """minillm's code re-run from its own source in the learner's namespace (what copy-paste gives)."""
    fn = getattr(obj, "fn", obj)
    src = textwrap.dedent(inspect.getsource(fn))
    home = sys.modules[fn.__module__]
    for k, v in vars(home).items():
        if not k.startswith("__"):
            vars(mod).setdefault(k, v)
    run_cell(mod, src)
    return vars(mod)[fn.__name__]


def _function_delegations(ref):
    mod = learner_module()
    vars(mod)["ref"] = ref
    run_cell(mod, "def wrapper(*args, **kwargs):\n    return ref(*args, **kwargs)\n")
    yield "itself", ref
    yield "partial", functools.partial(ref)
    yield "wrapper", vars(mod)["wrapper"]
    yield "copy", _copy_source(ref, learner_module())


def _class_delegations(engine_cls, methods):
    mod = learner_module()
    vars(mod)["Engine"] = engine_cls
    run_cell(mod, "class Sub(Engine):\n    pass\n")
    body = "".join(f"    def {m}(self, *a, **k):\n        return super().{m}(*a, **k)\n" for m in methods
                   if not m.startswith("__"))
    run_cell(mod, "class CallsSuper(Engine):\n" + body)
    forward = "".join(f"    def {m}(self, *a, **k):\n        return self.inner.{m}(*a, **k)\n" for m in methods)
    run_cell(mod, "class Forwards:\n    def __init__(self, *a, **k):\n        self.inner = Engine(*a, **k)\n"
             + forward)
    yield "itself", engine_cls
    yield "subclass", vars(mod)["Sub"]
    yield "super", vars(mod)["CallsSuper"]
    yield "composition", vars(mod)["Forwards"]
    yield "copy", _copy_source(engine_cls, learner_module())


def _method_delegations(base, methods):
    mod = learner_module()
    vars(mod)["Base"] = base
    vars(mod)["functools"] = functools
    src = {
        "alias": "".join(f"    {m} = Base.{m}\n" for m in methods),
        "partialmethod": "".join(f"    {m} = functools.partialmethod(Base.{m})\n" for m in methods),
        "wrapper": "".join(f"    def {m}(self, *a, **k):\n        return Base.{m}(self, *a, **k)\n" for m in methods),
        "super": "".join(f"    def {m}(self, *a, **k):\n        return super().{m}(*a, **k)\n" for m in methods),
        "copy": "".join(textwrap.indent(textwrap.dedent(inspect.getsource(vars(base)[m])), "    ") for m in methods),
    }
    home = sys.modules[base.__module__]
    for k, v in vars(home).items():
        if not k.startswith("__"):
            vars(mod).setdefault(k, v)
    for name, body in src.items():
        run_cell(mod, f"class Answer_{name}(Base):\n{body}")
        yield name, vars(mod)[f"Answer_{name}"]


def delegations(task):
    engine = task.engine_objects() or task.oracle_objects()
    if task.kind == "function":
        return list(_function_delegations(engine[0]))
    if task.kind == "class":
        return list(_class_delegations(engine[0], task.methods))
    return list(_method_delegations(task.base, task.methods))


DELEGATION_CASES = [(tid, name) for tid in sorted(TASKS) for name, _ in delegations(TASKS[tid]) if name != "copy"]
COPY_CASES = sorted(tid for tid in TASKS if any(name == "copy" for name, _ in delegations(TASKS[tid])))
# minillm's sizing function takes (config, tokens, dtype_bytes), not the task's (cfg, batch, seq, dtype), and lab03_2's
# oracle takes (scores, values): a wrapper or a copy of them is refused as a wrong answer (it cannot even be called
# that way) before any delegation shows. lab07_1's engine object is the RejectionSampler class, called with a batch
# (target_probs, draft_token_ids, draft_probs, generators), not one request's rule. lab08_1's engine object is
# formats.quantize(w, spec): quantize_int8(w) has no spec.
SIGNATURE_DIFFERS = {("lab01_2", "wrapper"), ("lab03_2", "wrapper"), ("lab07_1", "wrapper"),
                     ("lab08_1", "wrapper")}
# lab03_3's answer is a @triton.jit kernel: a Python wrapper around minillm's is refused as not being a kernel.


@pytest.mark.parametrize("tid, how", DELEGATION_CASES)
def test_delegation_to_minillm_is_refused(tid, how):
    answer = dict(delegations(TASKS[tid]))[how]
    with pytest.raises(GradingError) as e:
        TASKS[tid].check(answer)
    msg = str(e.value)
    reasons = ("minillm's own", "grader's reference", "does not define")
    if (tid, how) in SIGNATURE_DIFFERS:
        reasons += ("raised TypeError",)
    if tid == "lab03_3":
        reasons += ("pass the @triton.jit kernel itself",)
    assert any(s in msg for s in reasons), msg


@pytest.mark.parametrize("tid", COPY_CASES)
def test_a_copy_of_minillms_code_is_graded_by_its_behaviour(tid, capsys):
    """No checker fails an answer for its form: minillm's own source pasted into the answer cell is the learner's code
    as far as the verdict goes. It passes where it computes the piece (a long verbatim copy gets a note for the
    instructor), and fails only for what it does: another piece's signature or kind, or running minillm's
    implementation of the piece at run time (its helpers came along from minillm's module)."""
    answer = dict(delegations(TASKS[tid]))["copy"]
    try:
        TASKS[tid].check(answer)
    except GradingError as e:       # for what it does (another piece's signature, minillm's helpers at run time)
        assert "is a copy" not in str(e) and "copy of minillm" not in str(e), str(e)
        return
    noted = core.copy_note(answer, core.fingerprints(TASKS[tid].engine_objects())) is not None
    assert ("note for your instructor" in capsys.readouterr().out) == noted


def test_raising_the_graders_own_exceptions_ends_in_a_failure():
    """The grader's control-flow exceptions (the tracer's stop, a time limit) raised by the answer itself do not end
    the check with a pass."""
    mod = learner_module()
    run_cell(mod, "from minillm.grading import core\n"
                  "def stop(flops, nbytes, peak_flops, bandwidth):\n    raise core.Delegated()\n"
                  "def timeout(flops, nbytes, peak_flops, bandwidth):\n"
                  "    raise core.TimedOut(core._LIMITS[-1] if core._LIMITS else None, '')\n")
    with pytest.raises(GradingError, match="the grader's own signal"):
        TASKS["lab00_3"].check(vars(mod)["stop"])
    with pytest.raises(BaseException) as e:        # not its own limit: it leaves the check, the cell fails
        TASKS["lab00_3"].check(vars(mod)["timeout"])
    assert isinstance(e.value, (GradingError, core.TimedOut)), e.value


# ---------------------------------------------------------------- no private names of engine objects

ALLOWED_PRIVATE = {"_partialmethod", "_getframe",   # functools' and sys's own, read by the framework
                   "_fields", "_replace",           # a namedtuple's (public) field names and copy-with-changes
                   "_oid"}                          # wire.Proxy's own slot (written with object.__setattr__)


def _private_accesses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and node.attr not in own and node.attr not in ALLOWED_PRIVATE:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return bad


def test_graders_and_labs_use_no_private_engine_names():
    files = sorted((ROOT / "minillm" / "grading").glob("*.py")) + [ROOT / "minillm" / "testing.py"] + \
        sorted((ROOT / "solutions").glob("lab*/lab*.py"))
    bad = [b for f in files for b in _private_accesses(f)]
    assert not bad, "private names reached from graders/labs:\n" + "\n".join(bad)
