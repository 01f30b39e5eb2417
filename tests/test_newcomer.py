"""What a newcomer trips on, each fixed with the error or output they should get (issue: a newcomer's first hour).

Mistakes are refused before anything loads (the model load is replaced by a stub that fails the test if reached),
with a message that names the mistake and what to do instead.
"""
from __future__ import annotations

from unittest import mock

import pytest

from minillm.cli import main
from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.prompt import check_messages
from minillm.llm import LLM
from minillm.testing import tiny_model
from tests.tiny_models import tiny_model_dir


class Loaded(Exception):
    """The stub's signal: the command got as far as loading the model."""


def _no_load(*args, **kwargs):
    raise Loaded


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", context=64)


def test_a_system_prompt_without_chat_mode_is_refused_before_loading(capsys):
    with mock.patch("minillm.executor.launch.start_engine", _no_load):
        assert main(["generate", "hi", "--no-chat", "--system", "be brief"]) == 2
    assert "--system needs chat mode" in capsys.readouterr().err


def test_chat_messages_are_checked_before_the_template():
    check_messages([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    for bad, needle in (([{"role": "wizard", "content": "hi"}], "role 'wizard'"),
                        ([{"role": "user"}], "'role' and 'content'"),
                        ([{"role": "user", "content": 3}], "content must be text"),
                        ([], "at least one message"), (["hi"], "must be a dict")):
        with pytest.raises(ValueError, match=needle):
            check_messages(bad)


def test_an_absurd_draft_length_is_refused_with_the_reason():
    EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 32})
    with pytest.raises(ValueError, match="more than 32: a whole k-token draft survives"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 1000})


def test_a_model_that_is_not_a_path_is_named():
    with mock.patch("minillm.executor.launch.start_engine", _no_load), \
            pytest.raises(TypeError, match="model must be 'default', a .gguf file or a Hugging Face directory"):
        LLM(123)


def test_a_long_prompt_gets_the_advice_that_helps():
    """Which limit the prompt hit decides the advice: max_model_len (raise it), or the KV pool (a bigger budget)."""
    model = tiny_model()
    context = model.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=rf"raise max_model_len \(--max-model-len; the model allows {context}\)"):
        LLMEngine.from_model(model, max_model_len=5).add_request(list(range(3, 10)))
    with pytest.raises(ValueError, match="larger KV budget"):
        LLMEngine.from_model(model, num_blocks=1, block_size=4).add_request(list(range(3, 10)))


def test_a_max_model_len_below_the_prompt_is_refused_before_the_weights_load(tiny_dir, capsys):
    """The tokenizer alone tells the prompt's length: the weights never load (the stub fails if reached)."""
    argv = ["generate", "ab " * 20, "--model", str(tiny_dir), "--no-chat", "--max-model-len"]
    with mock.patch("minillm.executor.launch.start_engine", _no_load):
        assert main(argv + ["5"]) == 2
        err = capsys.readouterr().err
        assert "tokens long" in err and "the longest sequence is 5 tokens (--max-model-len 5)" in err, err
        assert "raise --max-model-len (the model allows 64)" in err, err
        assert main(argv + ["60"]) == 1                  # a limit the prompt fits goes on to the load (the stub)
        assert "internal error: Loaded" in capsys.readouterr().err


def test_generate_reports_its_speed(tiny_dir, capsys):
    argv = ["generate", "ab", "--model", str(tiny_dir), "--no-chat", "--max-tokens", "6", "--temperature", "0"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tokens in" in err and "first token after" in err, err


def test_version():
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0


@pytest.mark.parametrize("argv, needle", [
    (["generate", "hi", "--dtype", "int8"], "dtype"),
    (["generate", "hi", "--quantization", "banana"], "quantization"),
    (["generate", "hi", "--attention-backend", "banana"], "attention backend"),
    (["generate", "hi", "--device", "gpu"], "unknown device 'gpu': use one of auto, cpu, cuda, cuda:N, meta"),
    (["bench", "decode", "--device", "cuda:x"], "unknown device 'cuda:x'"),
    (["bench", "throughput", "--device", "tpu"], "unknown device 'tpu'"),
    (["generate", "", "--no-chat"], "prompt is empty"),
    (["generate", "hi", "--no-chat", "--system", "x"], "--system needs chat mode"),
    (["generate", "hi", "--regex", "(a|b)*a(a|b){14}"], "automaton states"),      # a state blowup, compiled first
])
def test_bad_flags_fail_before_torch_is_imported(argv, needle):
    """Counted, not timed: the process that refuses the flag never imported torch (the slow part of a start)."""
    import subprocess
    import sys
    code = ("import sys; from minillm.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and needle in done.stderr, done.stderr
    assert done.stdout.strip().endswith("NO-TORCH"), (done.stdout, done.stderr)


def test_errors_name_the_file_or_the_flag(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type":')             # a truncated download
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'} is not valid JSON" in err and "\n" == err[-1] and err.count("\n") == 1
    with mock.patch("minillm.executor.launch.start_engine", _no_load):
        assert main(["generate", "hi", "--json-object", "--whitespace-pattern", "("]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --whitespace-pattern '(':") and len(err) < 200, err
    (tmp_path / "schema.json").write_text('{"type": "object", "properties": {"a": ')
    with mock.patch("minillm.executor.launch.start_engine", _no_load):
        assert main(["generate", "hi", "--json-schema", str(tmp_path / "schema.json")]) == 2
    err = capsys.readouterr().err
    assert f"the file {tmp_path / 'schema.json'} is not valid JSON" in err and "truncated" in err, err
    for value, needle in (("1PiB", "KiB/MiB/GiB"), ("-1GiB", "positive size")):
        with pytest.raises(ValueError, match=needle):
            EngineConfig.from_kwargs(kv_cache_memory=value)


def test_the_progress_bar_rate_is_never_a_misleading_zero():
    """One token in 2.5 s (a long prefill on a busy machine) is 0.4 tok/s; the bar used to print it as 0."""
    from minillm.llm import rate
    assert [rate(1, 2.5), rate(0, 1.0), rate(33, 10.0), rate(1234, 1.0)] == ["0.4", "0", "3.3", "1234"]


def test_the_checkpoints_recommended_sampling_is_used_and_said(tiny_dir, tmp_path, capsys):
    """generation_config.json's settings are the defaults (flags still win), and the command says which it used."""
    import shutil

    from minillm.cli import _params, build_parser
    from minillm.loading.loader import sampling_defaults
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    assert sampling_defaults(model) == {}                                  # none recorded: SamplingParams' own
    (model / "generation_config.json").write_text('{"temperature": 0.3, "top_p": 0.8, "top_k": 20, "do_sample": true}')
    rec = sampling_defaults(model)
    assert rec == {"temperature": 0.3, "top_p": 0.8, "top_k": 20} and isinstance(rec["top_k"], int)
    args = build_parser().parse_args(["generate", "hi", "--top-p", "0.5"])
    p = _params(args, rec)
    assert (p.temperature, p.top_p, p.top_k) == (0.3, 0.5, 20)             # the flag beats the recommendation
    assert _params(build_parser().parse_args(["generate", "hi"])).temperature == 0.7   # no recommendation
    argv = ["generate", "ab", "--model", str(model), "--no-chat", "--max-tokens", "2", "--top-p", "0.5"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[sampling: temperature 0.3, top-k 20, the model's recommended settings (--temperature / --top-k" in err


@pytest.mark.slow    # the real SmolLM2's file
def test_the_default_model_samples_as_its_card_recommends():
    from minillm.loading.default_model import DEFAULT_SAMPLING
    from minillm.loading.loader import sampling_defaults
    assert sampling_defaults("default") == DEFAULT_SAMPLING == {"temperature": 0.2, "top_p": 0.9}


@pytest.mark.slow    # the real SmolLM2
def test_an_empty_raw_completion_says_why():
    """SmolLM2-Instruct continuing raw text emits EOS first: the '' comes with the reason and the fix."""
    from minillm import SamplingParams
    with LLM("default") as llm:
        assert llm.get_default_sampling_params().temperature == 0.2
        with pytest.warns(UserWarning, match=r"end-of-sequence token first.*llm\.chat"):
            out = llm.generate("What is 2+2?", SamplingParams(temperature=0), use_tqdm=False)
        assert out[0].text == ""
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")                                 # an answer through chat: no warning
            assert llm.generate("What is 2+2?", SamplingParams(temperature=0, max_tokens=8), chat=True,
                                use_tqdm=False)[0].text
