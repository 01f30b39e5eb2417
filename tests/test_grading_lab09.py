"""lab09 checkers, graded both ways: minillm's own tensor-parallel rules (MegatronRules) pass the property suites;
plausible wrong versions of each piece are rejected with the diagnosis a learner needs; correct learner versions
written differently from minillm's pass."""
import torch
import torch.nn.functional as F
import pytest

from minillm.grading.lab09 import (TASKS, CommBytesRef, check_lab09_1, check_lab09_2, check_lab09_3, check_lab09_4,
                                   column_rows_ref, row_cols_ref)
from minillm.layers.linear import MEGATRON, MegatronRules
from grading_helpers import rejected


# ---------------------------------------------------------------- the oracles agree with the engine

def test_the_oracles_agree_with_minillm_where_both_are_defined():
    for n in range(1, 20):
        for w in range(1, 9):
            for r in range(w):
                if n % w and w % n:
                    with pytest.raises(ValueError):
                        column_rows_ref(n, 3, r, w)
                    with pytest.raises(ValueError):
                        MEGATRON.column_rows(n, 3, r, w)
                else:
                    assert column_rows_ref(n, 3, r, w) == MEGATRON.column_rows(n, 3, r, w)
                if n % w == 0:
                    assert row_cols_ref(n, r, w) == MEGATRON.row_cols(n, r, w)


# ---------------------------------------------------------------- lab09_1 column_rows

def test_lab09_1_minillm_column_rows_passes():
    TASKS["lab09_1"].verify(MEGATRON.column_rows)


def test_lab09_1_rejects_minillm_column_rows():
    rejected(check_lab09_1, MegatronRules.column_rows, "minillm's own answer")
    rejected(check_lab09_1, lambda n, s, r, w: MEGATRON.column_rows(n, s, r, w), "runs minillm's own implementation")
    rejected(check_lab09_1, column_rows_ref, "minillm's own answer")


def column_rows(num_units, unit_size, rank, world_size, *, replicate="consecutive", split="units", uneven="raise"):
    """A learner's column_rows, with switches for the classic mistakes."""
    if split == "rows":                                   # cut the part's rows, ignoring where heads end
        per = num_units * unit_size // world_size
        return range(rank * per, (rank + 1) * per)
    if num_units % world_size == 0 or (replicate == "floor" and num_units > world_size):
        per = num_units // world_size
        return range(rank * per * unit_size, (rank + 1) * per * unit_size)
    if world_size % num_units == 0:
        if replicate == "floor":                          # no replication: num_units // world_size is 0
            per = num_units // world_size
            return range(rank * per * unit_size, (rank + 1) * per * unit_size)
        if replicate == "modulo":                         # round-robin instead of with the query group
            unit = rank % num_units
        elif replicate == "all":                          # every rank keeps every KV head
            return range(0, num_units * unit_size)
        else:
            copies = world_size // num_units
            unit = rank // copies
        return range(unit * unit_size, (unit + 1) * unit_size)
    if uneven == "assert":
        assert False, "cannot shard"
    if uneven == "floor":
        per = num_units // world_size
        return range(rank * per * unit_size, (rank + 1) * per * unit_size)
    raise ValueError(f"{num_units} units cannot be sharded over {world_size} ranks")


def test_lab09_1_a_correct_learner_version_passes():
    check_lab09_1(lambda n, s, r, w: column_rows(n, s, r, w))


COLUMN_WRONG = {
    "KV heads dealt round-robin": (dict(replicate="modulo"), "rank % num_units"),
    "no replication: empty ranges": (dict(replicate="floor"), "an empty range"),
    "every rank keeps all KV heads": (dict(replicate="all"), "range(0, 8)"),
    "rows cut through heads": (dict(split="rows"), "not whole units"),
    "no ValueError when nothing divides": (dict(uneven="floor"), "raise ValueError"),
    "an assert instead of a ValueError": (dict(uneven="assert"), "raised AssertionError, expected a ValueError"),
}


@pytest.mark.parametrize("name", sorted(COLUMN_WRONG))
def test_lab09_1_wrong_versions_fail_with_their_diagnosis(name):
    kw, needle = COLUMN_WRONG[name]
    rejected(check_lab09_1, lambda n, s, r, w: column_rows(n, s, r, w, **kw), needle, "Hint")


def test_lab09_1_a_value_error_without_a_message_is_rejected():
    def silent(n, s, r, w):
        if n % w and w % n:
            raise ValueError()
        return column_rows(n, s, r, w)
    rejected(check_lab09_1, silent, "without a message")


def test_lab09_1_types_are_exact():
    rejected(check_lab09_1, lambda n, s, r, w: list(column_rows(n, s, r, w)), "must be a range")
    rejected(check_lab09_1, lambda n, s, r, w: (column_rows(n, s, r, w).start, column_rows(n, s, r, w).stop),
             "must be a range")


# ---------------------------------------------------------------- lab09_2 row_cols

def test_lab09_2_minillm_row_cols_passes():
    TASKS["lab09_2"].verify(MEGATRON.row_cols)


def test_lab09_2_rejects_minillm_row_cols():
    rejected(check_lab09_2, MegatronRules.row_cols, "minillm's own answer")
    rejected(check_lab09_2, lambda n, r, w: MEGATRON.row_cols(n, r, w), "runs minillm's own implementation")


def row_cols(input_size, rank, world_size, *, how="blocks"):
    if how == "interleaved":                               # every world_size-th column
        return range(rank, input_size, world_size)
    if how == "all":                                       # every rank keeps the whole input
        return range(input_size)
    if how == "reversed":                                  # blocks, last rank first
        width = input_size // world_size
        start = (world_size - 1 - rank) * width
        return range(start, start + width)
    if how == "remainder_last":                            # uneven sizes: the last rank takes the rest
        width = input_size // world_size
        return range(rank * width, input_size if rank == world_size - 1 else (rank + 1) * width)
    if input_size % world_size != 0:
        raise ValueError(f"{input_size} columns do not divide over {world_size} ranks")
    width = input_size // world_size
    return range(rank * width, rank * width + width)


def test_lab09_2_a_correct_learner_version_passes():
    check_lab09_2(lambda n, r, w: row_cols(n, r, w))


ROW_WRONG = {
    "interleaved columns": ("interleaved", "one contiguous block"),
    "every rank keeps every column": ("all", "the shapes do not match"),
    "blocks in the wrong order": ("reversed", "the matching columns of down_proj"),
    "the last rank takes the remainder": ("remainder_last", "raise ValueError"),
}


@pytest.mark.parametrize("name", sorted(ROW_WRONG))
def test_lab09_2_wrong_versions_fail_with_their_diagnosis(name):
    how, needle = ROW_WRONG[name]
    rejected(check_lab09_2, lambda n, r, w: row_cols(n, r, w, how=how), needle, "Hint")


# ---------------------------------------------------------------- lab09_3 the forwards

def test_lab09_3_minillm_rules_pass():
    TASKS["lab09_3"].verify(MegatronRules)


def test_lab09_3_rejects_minillm_rules():
    rejected(check_lab09_3, MegatronRules, "minillm's own answer")

    class Inherits(MegatronRules):
        pass
    rejected(check_lab09_3, Inherits, "does not define column_forward")

    class CallsSuper(MegatronRules):
        def column_forward(self, x, weight, bias, comm):
            return super().column_forward(x, weight, bias, comm)

        def row_forward(self, x, weight, bias, comm):
            return super().row_forward(x, weight, bias, comm)
    rejected(check_lab09_3, CallsSuper, "runs minillm's own implementation")


def make_rules(*, column="local", row="reduce_then_bias"):
    """A learner's rules class (plain methods, not staticmethods), with switches for the classic mistakes."""
    class Rules:
        def column_forward(self, x, weight, bias, comm):
            up = column == "upcast" or (column == "upcast_half" and x.dtype == torch.float16)
            y = x.float() @ weight.float().t() if up else x @ weight.t()
            if column == "reduce":                            # an all-reduce after the column layer too
                comm.all_reduce(y)
            if bias is not None and column != "no_bias":
                y = y + bias
            return y

        def row_forward(self, x, weight, bias, comm):
            up = row == "upcast" or (row == "upcast_half" and x.dtype == torch.float16)
            partial = x.float() @ weight.float().t() if up else x @ weight.t()
            if row == "bias_first" and bias is not None:      # every rank adds the bias, then the sum
                partial = partial + bias
            if row == "gather":                               # treated as split by outputs: concatenate
                return comm.all_gather(partial, dim=-1)
            if row == "discard":                              # reduces a copy, keeps its own partial sum
                comm.all_reduce(partial.clone())
            elif row == "only_rank0":
                if comm.rank == 0:
                    comm.all_reduce(partial)
            elif row == "in_place_x":                         # sums the input instead of the product
                comm.all_reduce(x)
                partial = x @ weight.t() / comm.world_size
            elif row == "twice":                              # all-reduces the bias separately
                comm.all_reduce(partial)
                if bias is not None:
                    partial = partial + comm.all_reduce(bias / comm.world_size)
                    return partial
            elif row != "none":
                comm.all_reduce(partial)
            if row == "average":                              # all-reduce, then divide by the world size
                partial = partial / comm.world_size
            if bias is not None and row not in ("bias_first", "no_bias"):
                partial = partial + bias
            return partial.to(x.dtype) if up else partial     # cast back: the all-reduce was float32
    return Rules


def test_lab09_3_a_correct_learner_version_passes():
    check_lab09_3(make_rules())


def test_lab09_3_staticmethods_and_functional_code_pass():
    class Rules:
        @staticmethod
        def column_forward(x, weight, bias, comm):
            return F.linear(x, weight) if bias is None else torch.addmm(bias, x, weight.t())

        @staticmethod
        def row_forward(x, weight, bias, comm):
            out = comm.all_reduce(torch.mm(x, weight.t()))
            return out.add(bias) if bias is not None else out
    check_lab09_3(Rules)


FORWARD_WRONG = {
    "all-reduce after the column layer": (dict(column="reduce"), "your column_forward communicated"),
    "column bias forgotten": (dict(column="no_bias"), "the bias is missing"),
    "bias added on every rank before the all-reduce": (dict(row="bias_first"), "2 times"),
    "all-reduce then divide by the world size": (dict(row="average"), "averages"),
    "no all-reduce": (dict(row="none"), "sent nothing"),
    "row split treated as an output split (all_gather)": (dict(row="gather"), "used all_gather"),
    "the all-reduce's result thrown away": (dict(row="discard"), "was not used"),
    "the input all-reduced in place": (dict(row="in_place_x"), "changed its input x in place"),
    "two all-reduces": (dict(row="twice"), "made 2 all-reduces"),
    # bfloat16 layers computed in float32: the output's dtype, or (cast back) the all-reduce's bytes, shows it
    "column layer upcast to float32": (dict(column="upcast"), "keep the input's dtype"),
    "row partial sums all-reduced in float32": (dict(row="upcast"), "in bfloat16 is 8 bytes"),
    # float16 is drawn too: "float16 overflows, compute it in float32" changes the dtype or the wire's bytes
    "column layer upcasts float16 only": (dict(column="upcast_half"), "for torch.float16 inputs: keep the input's"),
    "row partial sums of float16 all-reduced in float32": (dict(row="upcast_half"), "in float16 is 8 bytes"),
}


@pytest.mark.parametrize("name", sorted(FORWARD_WRONG))
def test_lab09_3_wrong_versions_fail_with_their_diagnosis(name):
    kw, needle = FORWARD_WRONG[name]
    rejected(check_lab09_3, make_rules(**kw), needle, "Hint")


@pytest.mark.slow    # ~4-7 s: the quick subset stays under 3 minutes
def test_lab09_3_a_collective_only_some_ranks_call_fails_instead_of_hanging():
    rejected(check_lab09_3, make_rules(row="only_rank0"), "a collective that the other ranks never joined", "Hint")


def test_lab09_3_results_must_be_plain_tensors():
    class Numbers:
        @staticmethod
        def column_forward(x, weight, bias, comm):
            return (x @ weight.t()).tolist()

        @staticmethod
        def row_forward(x, weight, bias, comm):
            return x
    rejected(check_lab09_3, Numbers, "must be a torch.Tensor")


# ---------------------------------------------------------------- lab09_4 bytes per token

def test_lab09_4_the_reference_formulas_pass_and_are_refused_as_answers():
    TASKS["lab09_4"].verify(CommBytesRef)
    rejected(check_lab09_4, CommBytesRef, "itself")


def make_bytes(*, tp="right", pp="right"):
    tp_formulas = {"right": lambda h, n, b: 2 * n * h * b, "one": lambda h, n, b: n * h * b,
                   "weights": lambda h, n, b: 2 * n * h * h * b, "embedding": lambda h, n, b: (2 * n + 1) * h * b,
                   "bits": lambda h, n, b: 16 * n * h * b}
    pp_formulas = {"right": lambda h, p, b: (p - 1) * h * b, "stages": lambda h, p, b: p * h * b,
                   "both_ends": lambda h, p, b: 2 * (p - 1) * h * b}

    class CommBytes:
        def tp_bytes_per_token(self, hidden_size, num_layers, dtype_bytes):
            return tp_formulas[tp](hidden_size, num_layers, dtype_bytes)

        def pp_bytes_per_token(self, hidden_size, pp, dtype_bytes):
            return pp_formulas[pp_kind](hidden_size, pp, dtype_bytes)
    pp_kind = pp
    return CommBytes


def test_lab09_4_a_correct_learner_version_passes():
    check_lab09_4(make_bytes())


BYTES_WRONG = {
    "tp: one all-reduce per layer": (dict(tp="one"), "two per layer"),
    "tp: counting the weights": (dict(tp="weights"), "weights never move"),
    "tp: the embedding's all-reduce too": (dict(tp="embedding"), "embedding"),
    "tp: bits": (dict(tp="bits"), "that is bits"),
    "pp: a boundary per stage": (dict(pp="stages"), "pp - 1 boundaries"),
    "pp: send and receive both counted": (dict(pp="both_ends"), "sent once"),
}


@pytest.mark.parametrize("name", sorted(BYTES_WRONG))
def test_lab09_4_wrong_formulas_fail_with_their_diagnosis(name):
    kw, needle = BYTES_WRONG[name]
    rejected(check_lab09_4, make_bytes(**kw), needle, "Hint")
