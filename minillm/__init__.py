"""minillm: a from-scratch LLM inference engine, built up across graded labs.

    from minillm import LLM, SamplingParams, StructuredOutputsParams
"""
from minillm.sampling.params import SamplingParams
from minillm.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the loaders; import it on first use so `import minillm` stays light.
    if name == "LLM":
        from minillm.llm import LLM
        return LLM
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
