"""What every test_grading_labNN checks of a checker's refusal: the needles a learner needs, no traceback, short."""
import pytest


def rejected(checker, answer, *needles, example: bool = False) -> str:
    """`checker(answer)` must fail with a message holding every needle (and, with example=True, the smallest failing
    example and a hint), without a traceback, in fewer than 12 lines. Returns the message."""
    with pytest.raises(AssertionError) as e:
        checker(answer)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    if example:
        assert "Smallest failing example" in msg and "Hint" in msg, msg
    assert "Traceback" not in msg and len(msg.splitlines()) < 12, msg
    return msg
