"""Structured outputs on the real SmolLM2: every completed generation, across schemas, seeds and temperatures,
parses and validates (jsonschema) or fully matches (re), in one continuous batch."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from minillm import SamplingParams, StructuredOutputsParams as S
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import build_prompt_ids
from tests.test_engine import finish_all

USER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                                         "city": {"type": "string", "maxLength": 20}, "active": {"type": "boolean"}},
        "required": ["name", "age"]}
EVENT = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                          "date": {"type": "string", "format": "date"},
                                          "tags": {"type": "array", "items": {"enum": ["work", "fun", "family"]},
                                                   "maxItems": 3}},
         "required": ["title", "date"]}
CASES = [("Invent a user of a music app as JSON.", S(json=USER)),
         ("Describe a party as a JSON event.", S(json=EVENT)),
         ("What is the office phone number?", S(regex=r"\(\d{3}\) \d{3}-\d{4}")),
         ("Is Paris in France? Answer yes or no.", S(choice=["yes", "no"]))]


@pytest.mark.slow
def test_smollm2_constrained_outputs_always_validate(smollm):
    eng = LLMEngine.from_model(smollm.model, smollm.tokenizer)
    ids = {}
    for temperature in (0.0, 0.7, 1.2):
        for seed in range(2):
            for prompt, so in CASES:
                p = SamplingParams(temperature=temperature, seed=seed, max_tokens=96, structured_outputs=so)
                ids[eng.add_request(build_prompt_ids(smollm.tokenizer, prompt), p)] = so
    done = finish_all(eng)
    complete = 0
    for rid, out in done.items():
        so, o = ids[rid], out.outputs[0]
        if o.finish_reason != "stop":
            assert o.finish_reason == "length"
            continue
        complete += 1
        if so.json is not None:
            jsonschema.validate(json.loads(o.text), so.json, format_checker=jsonschema.FormatChecker())
        else:
            assert re.fullmatch(so.to_regex(), o.text, re.ASCII), o.text
    assert complete >= 0.8 * len(done), f"only {complete}/{len(done)} completed within 96 tokens"
