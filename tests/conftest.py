import os

# Kernels read TRITON_INTERPRET when they are decorated: set it before anything imports them.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


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
