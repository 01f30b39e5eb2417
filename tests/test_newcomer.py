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
    (["generate", "", "--no-chat"], "prompt is empty"),
    (["generate", "hi", "--no-chat", "--system", "x"], "--system needs chat mode"),
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
    for value, needle in (("1PiB", "KiB/MiB/GiB"), ("-1GiB", "positive size")):
        with pytest.raises(ValueError, match=needle):
            EngineConfig.from_kwargs(kv_cache_memory=value)


def test_the_progress_bar_rate_is_never_a_misleading_zero():
    """One token in 2.5 s (a long prefill on a busy machine) is 0.4 tok/s; the bar used to print it as 0."""
    from minillm.llm import rate
    assert [rate(1, 2.5), rate(0, 1.0), rate(33, 10.0), rate(1234, 1.0)] == ["0.4", "0", "3.3", "1234"]
