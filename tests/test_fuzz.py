"""Fuzz (issue 17): every input a user can give ends in a result or one clear error, and the engine stays usable.

Four surfaces, each drawn from a mix of valid values, edge values and wrong types:
- SamplingParams(...): constructs exactly when every field is inside the range this file writes down (SPEC, the
  documented contract, not a copy of the validation code); otherwise one ValueError naming a bad field. A constructed
  one runs in the engine next to a good request without changing that request's tokens.
- prompts through LLM.generate on a tiny model: a result or one clear ValueError/TypeError; afterwards the same LLM
  answers a good request with the tokens a fresh LLM gives, no request is left queued and every KV block is free.
- LLM(...) settings (every field of the config dataclasses, listed by minillm.config.setting_names): a bad value is
  one clear error before the model loads; an unknown keyword names the setting it was probably meant to be.
- every CLI subcommand and flag, enumerated from the argparse parser (a new flag is fuzzed without touching this
  file), run in-process through minillm.cli.main: exit 0, or exit 2 with one `error:` line; never a traceback, an
  'internal error' or an exception escaping; a bench count below 1 is refused before the model loads. generate,
  chat, bench decode and quiz run for real on a tiny model directory; the other benches and the demo stop where the
  model would load, and grade is left out (its first run imports Jupyter): the slow variant runs them all.

The non-slow tests keep to a few seconds (derandomized, few examples, @example for every hole found so far); the
*_more variants draw many more examples and are marked slow.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import sys
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from minillm import LLM, SamplingParams
from minillm.config import setting_names
from minillm.engine.llm_engine import LLMEngine
from minillm.structured.params import StructuredOutputsParams
from minillm.testing import random_model, tiny_tokenizer
from tests.tiny_models import tiny_model_dir

CONTEXT = 64          # the tiny model's context window: "over the context" is cheap to reach
VOCAB = tiny_tokenizer().vocab_size
NAN, INF = float("nan"), float("inf")


def fuzz(max_examples: int):
    """Derandomized (the same examples every run), no example database, no deadline (the first example pays for
    imports)."""
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", CONTEXT)


@pytest.fixture(scope="module")
def tiny_dir_long(tmp_path_factory):
    """The same with a 512-token context: room for the benches' and the demo's chat prompts."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model512", 512)


# ---------------------------------------------------------------------------------------------- SamplingParams

SOP = StructuredOutputsParams


def _number(v, lo: float, hi: float, lo_open: bool = False) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi


def _integer(v, lo: int, hi: float = math.inf) -> bool:
    return type(v) is int and lo <= v <= hi


# The contract, field by field (the ranges the docs and error messages promise); bools are not numbers here.
SPEC = {
    "temperature": lambda v: type(v) in (int, float) and (v == 0 or 0.01 <= v <= 100),
    "top_k": lambda v: _integer(v, -1, 2**31 - 1),
    "top_p": lambda v: _number(v, 0, 1, lo_open=True),
    "min_p": lambda v: _number(v, 0, 1),
    "repetition_penalty": lambda v: _number(v, 0.01, 100),
    "presence_penalty": lambda v: _number(v, -2, 2),
    "frequency_penalty": lambda v: _number(v, -2, 2),
    "seed": lambda v: v is None or _integer(v, 0, 2**64 - 1),
    "max_tokens": lambda v: _integer(v, 1),
    "stop": lambda v: (type(v) is str and v != "") or
                      (type(v) in (list, tuple) and all(type(s) is str and s for s in v)),
    "stop_token_ids": lambda v: type(v) in (list, tuple) and all(_integer(t, 0) for t in v),
    "ignore_eos": lambda v: type(v) is bool,
    "n": lambda v: _integer(v, 1, 1024),
    "logprobs": lambda v: v is None or _integer(v, 0, 20),
    "skip_special_tokens": lambda v: type(v) is bool,
    "structured_outputs": lambda v: v is None or isinstance(v, SOP),
}
assert set(SPEC) == set(SamplingParams.__dataclass_fields__), "a new SamplingParams field needs its range in SPEC"

# Values inside the contract, per field (kept small where the engine would otherwise run long: n, max_tokens).
VALID = {
    "temperature": [0, 0.0, 0.01, 0.7, 1.0, 100.0],
    "top_k": [0, -1, 1, 3, 2**31 - 1],
    "top_p": [1e-9, 0.5, 1.0],
    "min_p": [0.0, 0.2, 1.0],
    "repetition_penalty": [0.01, 1.0, 1.3, 100.0],
    "presence_penalty": [-2.0, 0.0, 1.5, 2],
    "frequency_penalty": [-2, 0.0, 0.5, 2.0],
    "seed": [None, 0, 7, 2**64 - 1],
    "max_tokens": [1, 3, 10**9],
    "stop": [[], ["a"], "b", ("c", "de")],
    "stop_token_ids": [[], [0], [5, 200], (3,)],
    "ignore_eos": [False, True],
    "n": [1, 2, 3],
    "logprobs": [None, 0, 3, 20],
    "skip_special_tokens": [True, False],
    "structured_outputs": [None, SOP(regex="(yes|no)"), SOP(choice=["ab", "b"]), SOP(json_object=True)],
}
# Edge values and wrong types, tried on every field.
EDGE = [0, 1, -1, 2, 0.5, 1.5, 2.0, -0.5, NAN, INF, -INF, 10**30, -10**30, 2**63, 2**64, 1e-50, 1e300, "x", "1", "",
        [], [1], [-1], [10**9], ["a", ""], None, True, False, {"regex": "a"}]


def violations(kw: dict) -> set[str]:
    """The fields of `kw` outside the contract (and the one cross-field rule)."""
    bad = {name for name, v in kw.items() if not SPEC[name](v)}
    if not bad and kw.get("ignore_eos") is True and kw.get("structured_outputs") is not None:
        bad = {"ignore_eos", "structured_outputs"}
    return bad


def field_values(name: str):
    return st.one_of(st.sampled_from(VALID[name]), st.sampled_from(EDGE))


@st.composite
def sampling_kwargs(draw, values=field_values):
    names = draw(st.lists(st.sampled_from(sorted(SPEC)), unique=True, max_size=5))
    return {name: draw(values(name)) for name in names}


def check_sampling_params(kw: dict) -> None:
    bad = violations(kw)
    try:
        SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        m = re.match(r"invalid SamplingParams: (\w+) (must|cannot)", msg)
        assert m and "\n" not in msg, msg
        assert m.group(1) in bad, f"{kw}: the error names {m.group(1)}, but the bad fields are {bad}: {msg}"
        return
    assert not bad, f"SamplingParams({kw}) was accepted, but {sorted(bad)} are outside the contract"


@example(kw={"temperature": NAN})
@example(kw={"temperature": INF})
@example(kw={"temperature": 1e-50})
@example(kw={"seed": "x"})
@example(kw={"seed": 2**64})
@example(kw={"top_k": 10**20})
@example(kw={"stop_token_ids": [-1]})
@example(kw={"stop_token_ids": None})
@example(kw={"stop": 5})
@example(kw={"ignore_eos": "yes"})
@example(kw={"repetition_penalty": 1e-300})
@example(kw={"n": 10**9})
@example(kw={"max_tokens": 2.0})
@example(kw={"ignore_eos": True, "structured_outputs": SOP(regex="a")})
@given(kw=sampling_kwargs())
@fuzz(100)
def test_sampling_params_construct_or_one_clear_error(kw):
    check_sampling_params(kw)


@pytest.mark.slow
@given(kw=sampling_kwargs())
@fuzz(600)
def test_sampling_params_construct_or_one_clear_error_more(kw):
    check_sampling_params(kw)


GOOD_PROMPT = "hello world"
GOOD = SamplingParams(temperature=0, max_tokens=6)


def fresh_engine(model, tok) -> LLMEngine:
    # a tight pool, few running sequences and a short context: preemption and the context limit are in play
    return LLMEngine.from_model(model, tok, num_blocks=24, block_size=4, max_num_seqs=3, max_model_len=24)


def finish(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def engine_case():
    """(engine used by every example, the good request's greedy tokens on a fresh engine)."""
    model, tok = random_model(vocab=VOCAB, max_pos=CONTEXT), tiny_tokenizer()
    ref_engine = fresh_engine(model, tok)
    rid = ref_engine.add_request(GOOD_PROMPT, GOOD)
    return fresh_engine(model, tok), finish(ref_engine)[rid].token_ids


def check_params_in_engine(engine_case, kw: dict, mutation: tuple | None, prompt) -> None:
    """A valid SamplingParams (perhaps changed after construction) runs next to a good greedy request: the good one
    gets its reference tokens, the other a well-formed result (or one ValueError before it is queued)."""
    engine, ref = engine_case
    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(**kw)
    if mutation is not None:
        setattr(params, *mutation)
    good = engine.add_request(GOOD_PROMPT, GOOD)
    free_before = engine.block_manager.num_free_blocks
    fields = {**kw, mutation[0]: mutation[1]} if mutation else kw
    past_vocab = isinstance(params.stop_token_ids, (list, tuple)) and \
        any(type(t) is int and t >= vocab for t in params.stop_token_ids)     # only the engine knows the vocabulary
    expect_error = bool(violations(fields)) or past_vocab
    try:
        rid = engine.add_request(prompt, params)
    except ValueError as e:
        assert expect_error, f"{kw} {mutation}: refused with {e}"
        assert "\n" not in str(e) and engine.block_manager.num_free_blocks == free_before
        rid = None
    else:
        assert not expect_error, f"{kw} {mutation}: accepted"
    done = finish(engine)
    assert done[good].token_ids == ref, "a request next to the fuzzed one got other greedy tokens"
    if rid is not None:
        out = done[rid]
        assert len(out.outputs) == params.n
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length") and all(0 <= t < vocab for t in c.token_ids)
            assert 0 < len(c.token_ids) <= params.max_tokens or c.finish_reason == "stop"
            assert params.logprobs is None or len(c.logprobs) == len(c.token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


MUTABLE = sorted(SPEC)


@example(kw={"temperature": 0.7, "seed": 3}, mutation=("temperature", NAN), prompt=[5, 6, 7])
@example(kw={}, mutation=("temperature", INF), prompt="abc")
@example(kw={}, mutation=("seed", "x"), prompt="abc")
@example(kw={"stop_token_ids": [10**9]}, mutation=None, prompt="abc")
@example(kw={}, mutation=("stop_token_ids", [-1]), prompt="abc")
@example(kw={"temperature": 0.7}, mutation=("top_k", 2**63), prompt="abc")      # once overflowed inside step()
@example(kw={"temperature": 0.7}, mutation=("seed", 2**64), prompt="abc")       # the same, in the generator
@example(kw={"temperature": 0.7}, mutation=("temperature", 1e-50), prompt="abc")  # sampled at T=1 silently
@example(kw={}, mutation=("stop", 5), prompt="abc")
@example(kw={}, mutation=("ignore_eos", "x"), prompt="abc")
@example(kw={"n": 3, "max_tokens": 10**9, "temperature": 1.0}, mutation=None, prompt="ab ab ab")
@example(kw={"structured_outputs": SOP(json_object=True), "max_tokens": 10**9}, mutation=None, prompt="x")
@example(kw={"repetition_penalty": 0.01, "temperature": 0.01, "top_k": 2**31 - 1}, mutation=None, prompt="ab")
@given(kw=sampling_kwargs(values=lambda name: st.sampled_from(VALID[name])).filter(lambda kw: not violations(kw)),
       mutation=st.none() | st.tuples(st.sampled_from(MUTABLE), st.sampled_from(EDGE)),
       prompt=st.sampled_from(["abc", "é中 ab", [1, 2, 3, 4, 5, 6, 7, 8, 9]]))
@fuzz(12)
def test_valid_params_run_in_the_engine_without_hurting_the_batch(engine_case, kw, mutation, prompt):
    check_params_in_engine(engine_case, kw, mutation, prompt)


@pytest.mark.slow
@given(kw=sampling_kwargs(values=lambda name: st.sampled_from(VALID[name])).filter(lambda kw: not violations(kw)),
       mutation=st.none() | st.tuples(st.sampled_from(MUTABLE), st.sampled_from(EDGE)),
       prompt=st.sampled_from(["abc", "é中 ab", [1, 2, 3, 4, 5, 6, 7, 8, 9]]))
@fuzz(40)
def test_valid_params_run_in_the_engine_without_hurting_the_batch_more(engine_case, kw, mutation, prompt):
    check_params_in_engine(engine_case, kw, mutation, prompt)


# ---------------------------------------------------------------------------------------------- prompts

@pytest.fixture(scope="module")
def llm_case(tiny_dir):
    """(an LLM every example reuses, the good request's greedy tokens from a fresh LLM)."""
    ref = LLM(str(tiny_dir), block_size=4, num_blocks=48).generate([GOOD_PROMPT], GOOD, use_tqdm=False)[0]
    return LLM(str(tiny_dir), block_size=4, num_blocks=48), ref.token_ids


TEXT = st.one_of(
    st.binary(max_size=24).map(lambda b: b.decode("utf-8", "surrogateescape")),     # how Python reads argv bytes
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(max_codepoint=0x2FFF),
            max_size=12),                                                             # lone surrogates among text
    st.sampled_from(["", " ", "\n\t  ", "<eos>", "<|im_start|>", "<|im_start|>user\nhi<|im_end|>\n", "\x00",
                     "\ufeff", "\uffff\U0010ffff", "é中", GOOD_PROMPT]),
    st.integers(CONTEXT, 3 * CONTEXT).map(lambda n: "ab " * n),                        # past the context window
)
TOKEN = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 100),
                  st.sampled_from([10**30, -1, 1.5, NAN, INF, "7", None, True, torch.tensor(3)]))
PROMPT = st.one_of(TEXT, st.lists(st.integers(0, VOCAB - 1), max_size=8), st.lists(TOKEN, max_size=4))


def well_formed(prompt) -> bool:
    """Text of valid UTF-8 short enough for the context, or a short list of in-vocabulary ids; never empty."""
    if isinstance(prompt, str):
        try:
            n = len(prompt.encode("utf-8"))                 # byte-level tokenizer: at most one token per byte
        except UnicodeEncodeError:
            return False
        return 0 < n < CONTEXT // 2
    return 0 < len(prompt) and all(type(t) is int and 0 <= t < VOCAB for t in prompt)


def check_prompts(llm_case, prompts: list, chat: bool) -> None:
    llm, ref = llm_case
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False, chat=chat)
    except (ValueError, TypeError) as e:
        assert "\n" not in str(e).strip(), str(e)
        assert chat or not all(well_formed(p) for p in prompts), f"{prompts!r} refused: {e}"
    else:
        assert len(outs) == len(prompts)
        assert all(len(o.token_ids) <= 3 and o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)[0].token_ids == ref


@example(prompts=[b"hello \xff\xfe world \xc3".decode("utf-8", "surrogateescape")], chat=False)
@example(prompts=["fine", "a\ud800b"], chat=False)
@example(prompts=["fine", ""], chat=False)
@example(prompts=["fine", "ab " * 200], chat=True)
@example(prompts=[[1, 2], [1.5, 2]], chat=False)
@example(prompts=[[1, 2], [INF]], chat=False)
@example(prompts=["<|im_start|>system\nx<|im_end|>"], chat=True)
@example(prompts=[[1, 2, 3]], chat=True)
@given(prompts=st.lists(PROMPT, min_size=1, max_size=3), chat=st.booleans())
@fuzz(20)
def test_any_prompt_gives_a_result_or_one_clear_error_and_the_llm_stays_usable(llm_case, prompts, chat):
    check_prompts(llm_case, prompts, chat)


@pytest.mark.slow
@given(prompts=st.lists(PROMPT, min_size=1, max_size=4), chat=st.booleans())
@fuzz(60)
def test_any_prompt_gives_a_result_or_one_clear_error_and_the_llm_stays_usable_more(llm_case, prompts, chat):
    check_prompts(llm_case, prompts, chat)


@pytest.mark.parametrize("prompts, words", [
    (None, "prompts must be a str or a list"), (b"hi", "decode them first"), ([1, 2, 3], "[[...]]"),
    ({"a": 1}, "got dict"), ([b"hi"], "decode the bytes"), ([None], "got NoneType"),
])
def test_a_prompt_of_the_wrong_type_is_a_type_error_naming_it(llm_case, prompts, words):
    with pytest.raises(TypeError, match=re.escape(words)):
        llm_case[0].generate(prompts, GOOD, use_tqdm=False)
    assert not llm_case[0].engine.has_unfinished_requests()


@pytest.mark.parametrize("params, words", [
    ({"temperature": 0}, "build one with SamplingParams(**settings)"), ("x", "got str"),
    ([None, None], "each must be a SamplingParams"), ([GOOD], "got 1 SamplingParams for 2 prompts"),
])
def test_sampling_params_of_the_wrong_shape_are_refused_before_anything_runs(llm_case, params, words):
    with pytest.raises((TypeError, ValueError), match=re.escape(words)):
        llm_case[0].generate(["a", "b"], params, use_tqdm=False)
    assert not llm_case[0].engine.has_unfinished_requests()


# ---------------------------------------------------------------------------------------------- LLM(...) settings

class Loaded(BaseException):
    """Raised where the model would load: reaching it means every check before the heavy work passed. A
    BaseException, so that no `except Exception` on the way mistakes it for an error of the code under test."""


def _engine_defaults() -> dict:
    from minillm.config import EngineConfig
    return EngineConfig().as_kwargs()


# What each kind of setting accepts; anything else must be refused before loading. The kind comes from the
# setting's default, so a new setting is fuzzed as soon as it exists.
def setting_ok(name: str, value, default) -> bool | None:
    """True / False where the contract is plain from the kind; None where only the code knows (a choice of names,
    sizes, dicts)."""
    if isinstance(default, bool):
        return type(value) is bool
    if name in ("max_model_len", "num_blocks", "pipeline_micro_batches") or isinstance(default, int):
        if value is None and default is None:
            return True
        if type(value) is not int or value < 1:
            return False
        return None             # a positive int: the model decides (tensor_parallel_size=2 on 4 heads, ...)
    if name == "kv_cache_memory":
        if type(value) is bool or not isinstance(value, (int, float, str)):
            return False
        if isinstance(value, (int, float)):
            return math.isfinite(value) and value >= 1
        return None
    return None


SETTING_VALUES = [0, 1, -1, 2, 3, 7, 1.5, 2.0, NAN, INF, 10**30, "", "x", "1", "2GiB", "1e400", "inf", "-1MiB",
                  "auto", "torch", "cpu", "triton", "float32", "bfloat16", "float64", "mp", "thread", "none", "int8",
                  None, True, False, [], [1], {}, {"method": "ngram"}, {"method": "nope"}, {"k": 3},
                  {"method": "ngram", "num_speculative_tokens": 0}, {"method": "draft_model"},
                  {"method": "layer_skip", "draft_layers": 1}]


def check_setting(tiny_dir, settings_: dict) -> None:
    defaults = _engine_defaults()
    verdicts = [setting_ok(k, v, defaults[k]) for k, v in settings_.items()]

    def stop(*args, **kwargs):
        raise Loaded
    with mock.patch("minillm.executor.launch.start_engine", stop):
        try:
            LLM(str(tiny_dir), **settings_)
        except Loaded:
            assert False not in verdicts, f"LLM(**{settings_}) reached the load with a bad value"
            return
        except (ValueError, TypeError) as e:
            msg = str(e)
            assert "\n" not in msg, msg
            named = [k for k in settings_ if k in msg or k.replace("_", " ") in msg or
                     (k == "speculative_config" and re.search("speculat|draft|method", msg))]
            assert named, f"the error for {settings_} names none of them: {msg}"
            assert not all(v is True for v in verdicts), f"LLM(**{settings_}) refused: {msg}"


@example(settings_={"block_size": 0})
@example(settings_={"kv_cache_memory": "inf"})
@example(settings_={"kv_cache_memory": None})
@example(settings_={"kv_cache_memory": True})
@example(settings_={"enable_prefix_caching": "no"})
@example(settings_={"dtype": "float64"})
@example(settings_={"dtype": 5})
@example(settings_={"attention_backend": "triton", "block_size": 3})
@example(settings_={"speculative_config": {"method": "draft_model", "model": 5}})
@example(settings_={"max_num_seqs": True})
@given(settings_=st.dictionaries(st.sampled_from(setting_names()), st.sampled_from(SETTING_VALUES), min_size=1,
                                 max_size=3))
@fuzz(100)
def test_bad_settings_are_one_clear_error_before_the_model_loads(tiny_dir, settings_):
    check_setting(tiny_dir, settings_)


@pytest.mark.slow
@given(settings_=st.dictionaries(st.sampled_from(setting_names()), st.sampled_from(SETTING_VALUES), min_size=1,
                                 max_size=4))
@fuzz(600)
def test_bad_settings_are_one_clear_error_before_the_model_loads_more(tiny_dir, settings_):
    check_setting(tiny_dir, settings_)


@st.composite
def typo(draw):
    """A setting name with one slip: a letter dropped or doubled, upper case, or dashes as on the command line."""
    name = draw(st.sampled_from(setting_names()))
    kind = draw(st.sampled_from(["drop", "double", "upper", "dash"]))
    i = draw(st.integers(0, len(name) - 1))
    wrong = {"drop": name[:i] + name[i + 1:], "double": name[:i] + name[i] + name[i:], "upper": name.upper(),
             "dash": name.replace("_", "-")}[kind]
    return name, wrong


@example(pair=("block_size", "block_sise"))
@example(pair=("max_num_seqs", "max_num_seq"))
@given(pair=typo())
@fuzz(25)
def test_an_unknown_setting_names_the_one_it_was_probably_meant_to_be(tiny_dir, pair):
    name, wrong = pair
    if wrong in setting_names():
        return                  # the slip made another real name (none does today)
    with pytest.raises(TypeError) as e:
        LLM(str(tiny_dir), **{wrong: 1})
    msg = str(e.value)
    assert f"unknown engine setting(s) {wrong} (did you mean " in msg and name in msg.split("valid:")[0], msg


@pytest.mark.parametrize("field", sorted(SPEC))
def test_a_sampling_setting_given_to_llm_says_where_it_goes(tiny_dir, field):
    with pytest.raises(TypeError, match=re.escape(f"pass SamplingParams({field}=...) to generate")):
        LLM(str(tiny_dir), **{field: 1})


RUNNABLE = {"block_size": [1, 3, 16], "num_blocks": [None, 2, 8, 64], "max_num_seqs": [1, 2, 64],
            "max_num_batched_tokens": [1, 5, 2048], "enable_prefix_caching": [True, False],
            "enable_chunked_prefill": [True, False], "max_model_len": [None, 2, 9, 10**9],
            "attention_backend": ["auto", "torch", "cpu"], "kv_cache_memory": ["64KiB", "1MiB", 10**7],
            "dtype": ["float32", "bfloat16"], "kv_cache_dtype": ["auto", "int8"],
            "speculative_config": [None, {"method": "ngram", "num_speculative_tokens": 2},
                                   {"method": "layer_skip", "draft_layers": 1}]}


@pytest.fixture(scope="module")
def x_reference(tiny_dir) -> list[int]:
    """The greedy tokens of the prompt "x" under the default settings."""
    return LLM(str(tiny_dir)).generate(["x"], X_PARAMS, use_tqdm=False)[0].token_ids


X_PARAMS = SamplingParams(temperature=0, max_tokens=4)


def check_runnable_settings(tiny_dir, x_reference: list[int], settings_: dict) -> None:
    """Settings that pass validation build an LLM that answers (or refuses a prompt with one ValueError), and a
    refused prompt leaves it able to answer the next one. In float32 with a float KV pool the greedy answer is the
    default settings' one (cut short where a small context or pool ends it): block size, pool, chunking, caching,
    backend and speculation change how it is computed, never what (an int8 pool may change it: test_kv_int8)."""
    try:
        llm = LLM(str(tiny_dir), **settings_)
    except ValueError as e:           # e.g. 2 blocks of 1 token: no room for any prompt, said at construction
        assert "\n" not in str(e), str(e)
        return
    for prompts in (["ab " * 20, "x"], ["x"]):
        try:
            outs = llm.generate(prompts, X_PARAMS, use_tqdm=False)
        except ValueError as e:
            assert "\n" not in str(e) and "prompt" in str(e), str(e)
        else:
            got = outs[-1].token_ids
            exact = settings_.get("dtype") != "bfloat16" and settings_.get("kv_cache_dtype") != "int8"
            assert 1 <= len(got) and (not exact or got == x_reference[:len(got)]), \
                (settings_, got, x_reference)
        assert not llm.engine.has_unfinished_requests()


@example(settings_={"num_blocks": 2, "block_size": 1})
@example(settings_={"max_num_batched_tokens": 1, "enable_chunked_prefill": False})
@example(settings_={"kv_cache_memory": "64KiB", "block_size": 16, "dtype": "bfloat16"})
@given(settings_=st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in RUNNABLE.items()}))
@fuzz(6)
def test_settings_that_pass_validation_run(tiny_dir, x_reference, settings_):
    check_runnable_settings(tiny_dir, x_reference, settings_)


@pytest.mark.slow
@given(settings_=st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in RUNNABLE.items()}))
@fuzz(20)
def test_settings_that_pass_validation_run_more(tiny_dir, x_reference, settings_):
    check_runnable_settings(tiny_dir, x_reference, settings_)


def test_config_knows_the_loaders_dtype_names():
    from minillm.config import DTYPE_NAMES
    from minillm.loading.loader import DTYPES
    assert set(DTYPE_NAMES) == set(DTYPES)


def test_a_kv_pool_too_large_to_reserve_is_a_clear_error(tiny_dir):
    with pytest.raises(ValueError, match=r"cannot reserve a KV pool of .* lower kv_cache_memory"):
        LLM(str(tiny_dir), num_blocks=10**15)


# ---------------------------------------------------------------------------------------------- the CLI

def _children(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return dict(sub.choices) if sub else {}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser; a command with subcommands of its own (`bench`) gives one per subcommand, keyed by
    the words that choose it ("bench kv")."""
    from minillm.cli import build_parser
    out = {}
    for name, parser in _children(build_parser()).items():
        nested = _children(parser)
        out.update({f"{name} {n}": p for n, p in nested.items()} if nested else {name: parser})
    return out


def parser_of(argv: list[str]) -> argparse.ArgumentParser | None:
    parsers = subcommands()
    return parsers.get(" ".join(argv[:2])) or parsers.get(argv[0])


# Small runs of each bench (only the flags that bench reads): placed before the drawn flags, which override them.
TINY_BENCH = {
    "decode": ["--prefill-lens", "8", "--steps", "1"],
    "throughput": ["--num-requests", "2", "--prompt-lens", "4", "8", "--output-lens", "2", "3",
                   "--baseline-batch-sizes", "1"],
    "kv": ["--num-requests", "2", "--prompt-lens", "4", "8", "--output-lens", "2", "3"],
    "prefix": ["--repeat", "1"],
    "spec": ["--proposers", "ngram", "--k", "2", "--batch-sizes", "1", "--tasks", "chat", "--batch1-requests", "1",
             "--max-tokens", "2", "--repeat", "1"],
    "structured": ["--batch-sizes", "1", "--max-tokens", "2", "--repeat", "1"],
    "parallel": ["--layouts", "tp1", "--batch-sizes", "1", "--steps", "1"],
}
POSITIONAL = {"prompt": ["hi", "", "  ", "<|im_start|>", b"caf\xc3 \xff".decode("utf-8", "surrogateescape")],
              "path": ["no-such.ipynb", "empty.ipynb", "notes.txt"]}
BAD_INTS = ["0", "-1", "x", "1.5", "nan", "", "99999999999999999999", "1e3"]
BAD_FLOATS = ["0", "-1", "nan", "inf", "-inf", "1e-50", "1e300", "x", ""]
BAD_TEXT = ["", "x", "-", "0", "-1", "nan", "{", "{}", "(", "a|b", "anki", "markdown", "ngram"]


def _valid_values(action: argparse.Action) -> list[str]:
    """Values the code itself calls normal for this flag: its argparse default, or the EngineConfig /
    SpeculativeConfig default behind it (engine flags default to None on the command line)."""
    from minillm.config import EngineConfig, SpeculativeConfig
    defaults = {**EngineConfig().as_kwargs(), **{"spec_" + k: f.default for k, f in
                                                 SpeculativeConfig.__dataclass_fields__.items()}}
    out = []
    for value in (action.default, defaults.get(action.dest)):
        for v in (value if isinstance(value, list) else [value]):
            if v is not None and not isinstance(v, (bool, dict)) and "MISSING" not in repr(v):
                out.append(str(v))
    return out + _tiny_values(action.option_strings[0])


def _tiny_values(flag: str) -> list[str]:
    """What the tiny bench defaults give `flag` (a valid, small value to draw besides the bad ones)."""
    for args in TINY_BENCH.values():
        if flag in args:
            i = args.index(flag) + 1
            out = []
            while i < len(args) and not args[i].startswith("--"):
                out.append(args[i])
                i += 1
            return out
    return []


def flag_values(action: argparse.Action):
    """Strategy for one flag's argument list (a missing value included), from the action's own description."""
    flag = st.sampled_from(action.option_strings)
    if action.nargs == 0:                                         # store_true, --x/--no-x
        return st.tuples(flag).map(list)
    if action.choices:
        one = st.sampled_from(list(action.choices) + ["nope", ""])
    elif action.type is int:
        one = st.sampled_from(BAD_INTS) | st.sampled_from(_valid_values(action) + ["1", "2", "7"])
    elif action.type is float:
        one = st.sampled_from(BAD_FLOATS) | st.sampled_from(_valid_values(action) + ["0.5", "1", "0.1", "1.3"])
    else:
        one = st.sampled_from(BAD_TEXT) | st.sampled_from(_valid_values(action) or BAD_TEXT)
    if action.dest == "model":
        one = st.sampled_from(["TINY", "TINY", "no/such/dir", "", "default.gguf"])
    if action.dest == "threads":
        one = st.sampled_from(["1", "0", "-1", "100000", "x"])
    if action.dest == "background_load":                          # each busy process spins a core for the run
        one = st.sampled_from(["0", "1", "-1", "x", "99999999999999999999"])
    if action.dest in ("tensor_parallel_size", "pipeline_parallel_size"):   # no size that would start processes
        one = st.sampled_from(["1", "0", "-1", "3", "x", "99999999999999999999"])
    count = {None: st.just(1), "?": st.integers(0, 1), "+": st.integers(1, 3), "*": st.integers(0, 2)}.get(
        action.nargs, st.just(action.nargs if isinstance(action.nargs, int) else 1))
    values = count.flatmap(lambda n: st.lists(one, min_size=n, max_size=n))
    missing = st.sampled_from([False] * 9 + [True])               # the flag with no value: a usage error
    return st.tuples(flag, values, missing).map(lambda t: [t[0]] if t[2] else [t[0], *t[1]])


SKIP_FLAGS = {"-h", "--help"}


@st.composite
def cli_argv(draw, exclude: tuple[str, ...] = ()):
    """[command, positionals..., drawn flags...], flags taken from the subcommand's parser."""
    parsers = subcommands()
    command = draw(st.sampled_from(sorted(c for c in parsers if c.split()[0] not in exclude)))
    parser = parsers[command]
    argv = command.split()
    for a in parser._actions:
        if not a.option_strings and a.dest != "help":
            argv.append(draw(st.sampled_from(list(a.choices) if a.choices else POSITIONAL.get(a.dest, ["x"]))))
    optional = [a for a in parser._actions if a.option_strings and not set(a.option_strings) & SKIP_FLAGS]
    for a in draw(st.lists(st.sampled_from(optional), max_size=3, unique_by=lambda a: a.dest)):
        argv += draw(flag_values(a))
    return argv


HEAVY_BENCHES = ("throughput", "kv", "prefix", "spec", "structured", "parallel")


def complete(argv: list[str], tiny: str) -> list[str]:
    """The drawn argv with the tiny model and small bench sizes first (drawn flags come later and win)."""
    argv = [tiny if a == "TINY" else a for a in argv]
    command, extra = argv[0], []
    parser = parser_of(argv)
    if parser is None:
        return argv
    if any("--model" in a.option_strings for a in parser._actions):
        extra = ["--model", tiny]
    if command == "bench" and len(argv) > 1 and argv[1] in TINY_BENCH:
        extra += TINY_BENCH[argv[1]]
    if command in ("generate", "chat"):
        extra += ["--max-tokens", "4"]
    n_pos = (2 if command == "bench" else 1) + sum(
        1 for a in parser._actions if not a.option_strings and a.dest != "help")
    return argv[:n_pos] + extra + argv[n_pos:]


def run_cli(argv: list[str], stop_heavy: bool) -> tuple[int | str, str, str, int]:
    """main(argv) in this process: (exit status or 'loaded', stdout, stderr, times the model loader was called).
    With stop_heavy, the benches other than decode and the demo stop where their model would load."""
    from minillm.cli import main
    import minillm.loading.loader as loader
    real_load, loads = loader.load_model, []
    heavy = stop_heavy and (argv[0] == "demo" or (argv[0] == "bench" and len(argv) > 1 and
                                                   argv[1] in HEAVY_BENCHES))

    def load(*args, **kwargs):
        loads.append(1)
        if heavy:
            raise Loaded
        return real_load(*args, **kwargs)

    def stop(*args, **kwargs):
        loads.append(1)
        raise Loaded
    out, err = io.StringIO(), io.StringIO()
    threads, stdin = torch.get_num_threads(), sys.stdin
    patches = [mock.patch.object(loader, "load_model", load),
               mock.patch("minillm.bench.decode.measure_bandwidth", lambda *a, **k: 1e10),  # seconds, no input
               mock.patch("minillm.serve.server.serve", stop)]   # flags checked; a server would run until stopped
    if heavy:
        patches += [mock.patch("minillm.bench.parallel.run_parallel_bench", stop),
                    mock.patch("minillm.bench.demo.run_demo", stop)]
    sys.stdin = io.StringIO("hello\n/nonsense\n/quit\n")
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = main(argv)
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
                except Loaded:
                    rc = "loaded"
    finally:
        sys.stdin = stdin
        torch.set_num_threads(threads)
    return rc, out.getvalue(), err.getvalue(), len(loads)


def bench_counts_below_one(argv: list[str]) -> list[str]:
    """The bench count flags (every int flag a bench reads, seed aside) given a value below 1, per the parser."""
    from minillm.cli import BENCH_FLAGS
    if argv[0] != "bench":
        return []
    parser = parser_of(argv)
    counts = {f for a in (parser._actions if parser else []) if a.type is int and a.dest in set().union(
        *BENCH_FLAGS.values()) - {"seed"} for f in a.option_strings}
    bad, current = [], None
    for a in argv[2:]:
        if a.startswith("--"):
            current = a if a in counts else None
        elif current and re.fullmatch(r"-?\d+", a) and int(a) < 1:
            bad.append(current)
    return bad


@pytest.fixture(scope="module")
def cli_home(tmp_path_factory):
    """A working directory (files a flag names are written there) with the grade inputs, and a quiz data dir."""
    home = tmp_path_factory.mktemp("cli")
    (home / "empty.ipynb").write_text("{}")
    (home / "notes.txt").write_text("not a notebook")
    return home


def check_cli(cli_home, tiny_dir, argv: list[str], stop_heavy: bool) -> int | str:
    argv = complete(argv, str(tiny_dir))
    cwd = os.getcwd()
    os.chdir(cli_home)
    try:
        with mock.patch.dict(os.environ, {"MINILLM_DATA_DIR": str(cli_home / "quiz"), "NO_COLOR": "1"}):
            rc, out, err, loads = run_cli(argv, stop_heavy)
    finally:
        os.chdir(cwd)
    where = f"minillm {' '.join(map(repr, argv))} -> {rc}\nstderr: {err[-1500:]}"
    assert "Traceback" not in err and "internal error" not in err, where
    assert rc in (0, 2, "loaded") or (rc == 1 and argv[0] in ("quiz", "grade")), where
    if rc == 2:
        lines = [line for line in err.splitlines() if re.match(r"(error|minillm[\w ]*): ", line) and "error: " in line]
        assert len(lines) == 1, where
    if bench_counts_below_one(argv):
        assert rc == 2 and loads == 0, f"bench count below 1 not refused before the load: {where}"
    return rc


# Command lines that once ended in a traceback, an 'internal error', a crash or a silent wrong run: each is now a
# usage error (exit 2, one error line), except the last, which runs (to the end of the context).
PAST_FAILURES = [
    ["generate", "hi", "--temperature", "nan"], ["generate", "hi", "--temperature", "inf"],
    ["generate", "hi", "--temperature", "1e-50"], ["generate", "hi", "--seed", "99999999999999999999"],
    ["generate", "hi", "--top-k", "99999999999999999999"], ["generate", "hi", "--kv-cache-memory", "inf"],
    ["generate", "hi", "--threads", "-1"], ["generate", "hi", "--threads", "0"],
    ["generate", "hi", "--threads", "100000"],                      # once a segfault in torch's thread pool
    ["generate", "hi", "--attention-backend", "triton", "--block-size", "3"],
    ["generate", b"hello \xff\xfe world \xc3".decode("utf-8", "surrogateescape")],
    ["bench", "kv", "--block-size", "0"], ["bench", "prefix", "--block-size", "0"],
    ["bench", "decode", "--prefill-lens", "0"], ["bench", "decode", "--prefill-lens", "20000"],
    ["bench", "kv", "--num-requests", "0"], ["bench", "kv", "--kv-budget-tokens", "0"],
    ["bench", "parallel", "--batch-sizes", "0"], ["bench", "structured", "--batch-sizes", "0"],
    ["bench", "throughput", "--baseline-batch-sizes", "0"], ["bench", "spec", "--batch1-requests", "0"],
    ["chat", "--top-p", "0"], ["quiz", "--n", "0"], ["generate", "hi", "--top-k"],
    ["generate", "hi", "--max-tokens", "99999999999999999999"],
]


@pytest.mark.parametrize("argv", PAST_FAILURES, ids=" ".join)
def test_cli_past_failures_are_clear_errors(cli_home, tiny_dir, argv):
    rc = check_cli(cli_home, tiny_dir, argv, stop_heavy=True)
    assert rc == (0 if argv is PAST_FAILURES[-1] else 2)


@given(argv=cli_argv(exclude=("grade",)))     # grade's first run imports Jupyter (~7 s): the slow variant has it
@fuzz(30)
def test_cli_flags_end_in_success_or_one_error_line(cli_home, tiny_dir, argv):
    check_cli(cli_home, tiny_dir, argv, stop_heavy=True)


@pytest.mark.slow
@given(argv=cli_argv())
@fuzz(60)
def test_cli_flags_end_in_success_or_one_error_line_more(cli_home, tiny_dir_long, argv):
    check_cli(cli_home, tiny_dir_long, argv, stop_heavy=False)
