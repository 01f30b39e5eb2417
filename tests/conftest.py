import json
import os

# Kernels read TRITON_INTERPRET when they are decorated: set it before anything imports them.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines run on the CPU unless a test asks for a device (device="auto" would pick a GPU where there is one):
# the suite holds the CPU engine; tests/test_cuda_engine.py holds the CUDA one.
os.environ.setdefault("MINILLM_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# Durations the tests measure but do not judge (a time budget is a measurement, not a correctness property): name ->
# seconds, collected through the `record_duration` fixture and written at session end to .pytest_durations.json.
_DURATIONS: dict[str, float] = {}
DURATIONS_FILE = ".pytest_durations.json"


@pytest.fixture(scope="session")
def record_duration():
    """record_duration(name, seconds): report a measured duration (never an assertion) in .pytest_durations.json
    (repo root, rewritten by each run that records any) and in the run's terminal summary."""
    def record(name: str, seconds: float) -> None:
        _DURATIONS[name] = round(float(seconds), 3)
    return record


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: a worker's durations come back in its workeroutput."""
    _DURATIONS.update(getattr(node, "workeroutput", {}).get("durations", {}))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):       # an xdist worker: hand them to the controller, which writes
        session.config.workeroutput["durations"] = dict(_DURATIONS)
    elif _DURATIONS:
        text = json.dumps(dict(sorted(_DURATIONS.items())), indent=1)
        (session.config.rootpath / DURATIONS_FILE).write_text(text + "\n")


def pytest_terminal_summary(terminalreporter, config):
    if _DURATIONS and not hasattr(config, "workerinput"):
        terminalreporter.section(f"measured durations (also in {DURATIONS_FILE})")
        for name, seconds in sorted(_DURATIONS.items()):
            terminalreporter.write_line(f"{seconds:9.1f} s  {name}")


@pytest.fixture(scope="session")
def default_model_path():
    from minillm.loading.default_model import default_model_path as find
    return find()  # raises with the install command if missing: a real failure, not a skip


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2 model, loaded once per test session (fp32)."""
    from minillm.loading.loader import load_model
    return load_model("default", "float32")


def pytest_collection_modifyitems(config, items):
    """Slow tests (notebook executions, the real model) first: with xdist the long ones then overlap instead of
    leaving one worker to finish the tail alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
