"""The command line, as a user runs it."""
import os
import subprocess
import sys

import pytest

from minillm.cli import build_parser, main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.mark.slow
def test_generate_france_answers_paris():
    r = run_cli("generate", "What is the capital of France?", "--max-tokens", "32", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.slow
def test_generate_raw_text_sampling_is_seeded():
    args = ("generate", "Once upon a time", "--no-chat", "--temperature", "0.8", "--top-p", "0.95", "--seed", "1",
            "--max-tokens", "12")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


@pytest.mark.slow
def test_chat_is_interactive_multi_turn():
    p = subprocess.run([sys.executable, "-m", "minillm", "chat", "--temperature", "0", "--max-tokens", "16"],
                       input="What is the capital of France?\n/reset\nAnd of Italy?\n/quit\n", capture_output=True,
                       text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and "conversation cleared" in p.stdout and p.stdout.count("assistant>") == 2


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "demo"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out and "usage" in out


@pytest.mark.parametrize("args, words", [
    (["generate", "hi", "--model", "/no/such/model.gguf"], "does not exist"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--temperature", "nan"], "temperature must be 0 (greedy) or a finite number"),
    (["generate", "hi", "--top-p", "inf"], "top_p"),
    (["generate", "hi", "--repetition-penalty", "0"], "repetition_penalty"),
    (["generate", "hi", "--draft-layers", "4"], "add --speculative"),
    (["generate", "hi", "--speculative", "layer_skip"], "draft_layers"),
    (["generate", "hi", "--speculative", "draft_model"], "needs `model`"),
    (["generate", "hi", "--speculative", "ngram", "--num-speculative-tokens", "0"], "positive integer"),
    (["bench", "spec", "--speculative", "ngram"], "--proposers"),
    (["generate", "hi", "--regex", "a(?=b)"], "lookahead"),
    (["generate", "hi", "--regex", "(ab"], "missing ')'"),
    (["generate", "hi", "--json-schema", "no-such-file.json"], "no such file"),
    (["generate", "hi", "--json-schema", '{"type": "integer", "minimum": 1}'], "minimum"),
    (["generate", "hi", "--json-schema", '{"type": '], "not valid JSON"),
    (["generate", "hi", "--whitespace-pattern", " "], "needs --json-schema"),
    (["generate", "hi", "--threads", "-1"], "--threads must be a positive integer"),
    (["generate", "hi", "--threads", "0"], "--threads must be a positive integer"),
    (["bench", "decode", "--prefill-lens", "0"], "--prefill-lens must be at least 1"),
    (["bench", "kv", "--num-requests", "0"], "--num-requests must be at least 1"),
    (["generate", "hi", "--tensor-parallel-size", "2"], "Valid sizes: 1, 3"),      # refused before any process
    (["generate", "hi", "--tensor-parallel-size", "0"], "tensor_parallel_size must be a positive integer"),
    (["generate", "hi", "--tensor-parallel-size", "3", "--pipeline-parallel-size", "2"], "together"),
    (["generate", "hi", "--distributed-executor-backend", "ray"], "distributed_executor_backend"),
    (["generate", "hi", "--kv-cache-dtype", "fp8"], "unknown kv_cache_dtype 'fp8': use one of auto, int8"),
    (["bench", "decode", "--quantization", "kv-int8"], "kv-int8 is a bench quality row"),
    (["bench", "decode", "--tensor-parallel-size", "3"], "bench parallel"),
    (["bench", "parallel", "--tensor-parallel-size", "3"], "--layouts"),
    (["bench", "decode", "--layouts", "tp1"], "--layouts does not apply to bench decode (it is for bench parallel)"),
    (["bench", "prefix", "--num-requests", "3"], "--num-requests does not apply to bench prefix"),
    (["bench", "kv", "--plot", "x.png"], "--plot does not apply to bench kv"),
    (["bench", "prefix", "--repeat", "0"], "--repeat must be at least 1"),
    (["bench", "parallel", "--steps", "0"], "--steps must be at least 1"),
    (["bench", "decode", "--background-load", "-1"], "--background-load must be at least 0, got -1"),
    (["bench", "decode", "--background-load", "100000"], "--background-load takes at most 64 busy processes"),
    (["bench", "throughput", "--background-load", "2"], "--background-load does not apply to bench throughput"),
    (["generate", "hi", "--kernel-threads", "some"], "kernel_threads='some'"),
])
def test_bad_input_is_a_clear_error(args, words, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and "Traceback" not in err


def test_corrupt_and_truncated_gguf(tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(64))
    assert main(["generate", "hi", "--model", str(junk)]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_truncated_default_model(tmp_path, default_model_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path.read_bytes()[: 5_000_000])
    assert main(["generate", "hi", "--model", str(cut)]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err or "corrupt" in err


def test_unsupported_architecture(tmp_path, capsys):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "unsupported architecture" in capsys.readouterr().err


@pytest.mark.slow
def test_prompt_longer_than_context(capsys):
    assert main(["generate", "word " * 9000, "--no-chat"]) == 2
    assert "context window" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_with_speculation_prints_the_same_text_and_its_acceptance():
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog."
    plain = run_cli("generate", prompt, "--temperature", "0", "--max-tokens", "40")
    spec = run_cli("generate", prompt, "--temperature", "0", "--max-tokens", "40", "--speculative", "ngram",
                   "--num-speculative-tokens", "4")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "fox" in spec.stdout
    assert "[speculative decoding:" in spec.stderr and "tokens per verification step" in spec.stderr


@pytest.mark.slow
def test_generate_with_a_json_schema_and_a_choice(tmp_path):
    import json
    import jsonschema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    (tmp_path / "user.json").write_text(json.dumps(schema))
    r = run_cli("generate", "Invent a user.", "--json-schema", str(tmp_path / "user.json"), "--seed", "3")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
    r = run_cli("generate", "Is the sea salty?", "--choice", "yes", "--choice", "no", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stderr


def test_an_unexpected_error_is_one_line_unless_debug(monkeypatch, capsys):
    import minillm.cli as cli

    def broken(args):
        raise RuntimeError("something nobody checked for")
    monkeypatch.setattr(cli, "cmd_generate", broken)
    assert main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("internal error: RuntimeError: something nobody checked for") and "--debug" in err
    assert "Traceback" not in err
    with pytest.raises(RuntimeError, match="nobody"):
        main(["generate", "hi", "--debug"])


def test_text_that_is_not_utf8_is_a_clear_error():
    from minillm.testing import tiny_tokenizer
    text = b"hello \xff\xfe world".decode("utf-8", "surrogateescape")   # what Python makes of such argv bytes
    with pytest.raises(ValueError, match=r"not valid UTF-8 \(it holds the bytes b'\\xff\\xfe'\)"):
        tiny_tokenizer().encode(text)
    assert tiny_tokenizer().decode(tiny_tokenizer().encode("héllo 中")) == "héllo 中"


def test_grade_refuses_a_file_that_is_not_a_notebook(tmp_path, capsys):
    for name, text in (("empty.ipynb", "{}"), ("junk.ipynb", "not json at all")):
        (tmp_path / name).write_text(text)
        assert main(["grade", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "is not a Jupyter notebook" in err and "Traceback" not in err


@pytest.mark.slow
def test_chat_ctrl_c_stops_the_answer_and_unknown_commands_are_reported():
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "minillm", "chat", "--temperature", "0.8", "--seed", "1",
                          "--max-tokens", "300"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV, bufsize=0)
    p.stdin.write("/nonsense\nTell me a very long story.\n")
    p.stdin.flush()
    seen = ""
    deadline = time.monotonic() + 900           # a hang guard, not a budget
    while "assistant> " not in seen or len(seen.split("assistant> ")[-1]) < 20:   # the answer is streaming
        char = p.stdout.read(1)
        assert char, f"chat exited before streaming an answer: {seen!r} {p.stderr.read()[-2000:]}"
        seen += char
        assert time.monotonic() < deadline, f"hung: no streaming answer after 900 s: {seen!r}"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate("And now a short one.\n/quit\n", timeout=900)
    out = seen + out
    assert p.returncode == 0, err
    assert "unknown command '/nonsense'" in out and "/reset" in out
    assert "[answer stopped" in out and out.count("assistant> ") == 2, out[-2000:]
    assert "Traceback" not in err
