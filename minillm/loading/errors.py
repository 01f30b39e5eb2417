"""The one error type model loading raises: the CLI prints its message instead of a traceback."""
from __future__ import annotations

MODEL_ARG_HELP = ('--model accepts "default", a .gguf file, or a Hugging Face directory '
                  "with config.json, *.safetensors and tokenizer.json")


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message says why and what to do about it."""
