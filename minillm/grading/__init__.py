"""Graders for the minillm labs: one module per lab (`minillm.grading.labNN`), checkers `check_labNN_K`.

A graded cell imports its checker afresh and calls it on the answer, e.g.
    from minillm.grading.lab01 import check_lab01_1; check_lab01_1(attend)
The framework (tasks, exact-type reads, delegation checks) is in `core`; fixtures shared with tests/ are in
`minillm.testing`. A check in the notebook is feedback; the verdict is `trusted`'s (`handin` takes the answers out of
the learner's kernel, `sandbox` runs the learner's code, `wire` carries the calls)."""
