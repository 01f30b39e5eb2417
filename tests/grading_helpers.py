"""What every test_grading_labNN checks of a checker's refusal: the needles a learner needs, no traceback, short, and
the hint of a first failure (a nudge: never the "Show me" line with the formula)."""
import pytest

from minillm.grading import core


def rejected(checker, answer, *needles, example: bool = False) -> str:
    """`checker(answer)`, as the task's first failure in the session, must fail with a message holding every needle
    (and, with example=True, the smallest failing example and a hint), without a traceback or the "Show me" line, in
    fewer than 12 lines. Returns the message."""
    core.reset_attempts()
    with pytest.raises(AssertionError) as e:
        checker(answer)
    core.reset_attempts()
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    if example:
        assert "Smallest failing example" in msg and "Hint" in msg, msg
    assert "Traceback" not in msg and "Show me" not in msg and len(msg.splitlines()) < 12, msg
    return msg
