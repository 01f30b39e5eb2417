"""Graders for the minillm labs: one module per lab (`minillm.grading.labNN`), checkers `check_labNN_K`.

Notebooks import the checkers of their lab, e.g. `from minillm.grading.lab01 import check_lab01_1`.
The framework (hypothesis settings, readable failures, rejecting minillm's own code) is in `core`."""
from minillm.grading.core import GradingError, Scorecard, reject_reference, run_property  # noqa: F401
