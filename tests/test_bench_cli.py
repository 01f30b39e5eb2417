"""`minillm bench`'s command line: one subparser per bench with only its own flags, the top-level help generated
from the registry, flag errors before torch, the kv cap warning and the repeats' spread warning. No model loads
except a tiny random one (bench kv), no timing asserted."""
from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys

import pytest

from minillm.bench.kv import concurrency_cap_warning, kv_bench
from minillm.bench.registry import BENCHES, FLAGS, PARALLEL, SPECULATIVE, ZERO_OK
from minillm.bench.spread import MAX_SPREAD, spread, spread_warning, warn_if_repeats_disagree
from minillm.bench.workload import WorkloadSpec, random_workload
from minillm.cli import build_parser, main
from minillm.config import EngineConfig


def help_of(*argv: str) -> str:
    out = io.StringIO()
    with pytest.raises(SystemExit) as e:
        from contextlib import redirect_stdout
        with redirect_stdout(out):
            build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return out.getvalue()


def listed_flags(text: str) -> set[str]:
    """The option strings a help text lists as options (its option lines, not flags named in its prose)."""
    flags = set()
    for line in text.splitlines():
        m = re.match(r"^  (-\S.*?)(?:  |$)", line)          # "  -h, --help   show ...": the part before the help
        if m:
            flags |= set(re.findall(r"(?<![\w-])(--?[\w-]+)", m.group(1)))
    return flags


def engine_flag(dest: str) -> str:
    return {"spec_method": "--speculative", "spec_num_speculative_tokens": "--num-speculative-tokens",
            "spec_model": "--draft-model", "spec_draft_layers": "--draft-layers",
            "spec_prompt_lookup_min": "--prompt-lookup-min",
            "spec_prompt_lookup_max": "--prompt-lookup-max"}.get(dest, "--" + dest.replace("_", "-"))


def expected_flags(bench) -> set[str]:
    flags = {"-h", "--help", "--model", "--threads", "--json"}
    flags |= {FLAGS[d].names[0] for d in bench.flags}
    flags |= {engine_flag(d) for d in (*bench.engine, *bench.speculative)}
    flags |= {"--no-" + engine_flag(d)[2:] for d in bench.engine if isinstance(EngineConfig().as_kwargs()[d], bool)}
    return flags


@pytest.mark.parametrize("name", list(BENCHES))
def test_each_bench_lists_only_its_own_flags(name):
    text = help_of("bench", name)
    bench = BENCHES[name]
    assert listed_flags(text) == expected_flags(bench)
    for part in ("measures:", "compares:", "takes:", "examples:", f"minillm bench {name}"):
        assert part in text, part
    others = {FLAGS[d].names[0] for d in FLAGS if d not in bench.flags} - expected_flags(bench)
    assert others and not others & listed_flags(text)


def test_kv_help_has_no_decode_or_engine_scheduling_flags():
    listed = listed_flags(help_of("bench", "kv"))
    assert {"--num-requests", "--kv-budget-tokens", "--reserve-len", "--block-size", "--model"} <= listed
    assert not {"--steps", "--llama-bench", "--prefill-lens", "--max-num-seqs", "--speculative", "--plot",
                "--tensor-parallel-size", "--repeat"} & listed


def test_bench_help_lists_every_bench_of_the_registry():
    text = help_of("bench")
    for name, bench in BENCHES.items():
        assert re.search(rf"^  {name} +{re.escape(bench.summary)}$", text, re.M), name
    sub = next(a for a in build_parser().bench_parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(BENCHES)
    assert "--model" in text and f"{round(100 * (MAX_SPREAD - 1))}%" in text


def test_every_bench_has_a_runner():
    from minillm.bench.cli import RUNNERS
    assert set(RUNNERS) == set(BENCHES)


def test_bench_list_prints_the_names(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--list"])
    assert e.value.code == 0 and capsys.readouterr().out.split() == list(BENCHES)


@pytest.mark.parametrize("argv, words", [
    (["bench", "kv", "--steps", "3"], "--steps does not apply to bench kv (it is for bench decode / parallel)"),
    (["bench", "kv", "--max-num-seqs", "4"], "--max-num-seqs does not apply to bench kv"),
    (["bench", "quality", "--block-size", "32"], "--block-size does not apply to bench quality"),
    (["bench", "prefix", "--no-enable-prefix-caching"], "with prefix caching off and on itself"),
    (["bench", "decode", "--speculative", "ngram"], "bench spec's (--proposers, --k)"),
    (["bench", "spec", "--num-speculative-tokens", "3"], "--proposers"),
    (["bench", "structured", "--pipeline-parallel-size", "2"], "bench parallel"),
    (["bench", "parallel", "--layouts", "tp2x2"], "unknown layout 'tp2x2'"),
    (["bench", "throughput", "--output-lens", "9", "3"], "--output-lens takes MIN MAX"),
    (["bench", "kv", "--num-requests", "0"], "--num-requests must be at least 1"),
    (["bench", "spec", "--k", "2", "0"], "--k must be at least 1"),
    (["bench", "throughput", "--quantization", "int4-gptq"], "bench quality only"),
])
def test_bench_flag_errors_come_before_torch(argv, words):
    """Refused in the parent process's first steps: torch is never imported (nothing loads)."""
    code = ("import sys; from minillm.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stderr
    assert r.stderr.startswith("error:") and words in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_refused_flags_have_a_reason_on_every_bench():
    """Every parallel or speculative flag a bench does not read is refused with a reason or pointed elsewhere."""
    for bench in BENCHES.values():
        for dest in (*PARALLEL, *SPECULATIVE):
            assert dest in bench.own() or dest in bench.refused or bench.name in ("kv", "quality"), (bench.name, dest)


# ------------------------------------------------------------------------------------------------ bench kv's cap

def kv(num_requests: int, budget: int) -> dict:
    wl = random_workload(128, WorkloadSpec(num_requests=num_requests, min_prompt=8, max_prompt=60, min_output=4,
                                           max_output=30, seed=3))
    return kv_bench(wl, budget_tokens=budget, block_size=8, max_model_len=128, bytes_per_token=4)


def test_kv_warns_when_num_requests_caps_the_ratio():
    capped = kv(num_requests=6, budget=4096)          # room for far more than 6 sequences
    assert capped["capped_by_num_requests"] and capped["paged_max_concurrency"] == 6
    warning = concurrency_cap_warning(capped)
    assert "--num-requests 6" in warning and "raise --num-requests" in warning and "\n" not in warning


def test_kv_does_not_warn_when_the_budget_limits():
    limited = kv(num_requests=64, budget=512)         # the pool, not the workload, limits concurrency
    assert not limited["capped_by_num_requests"] and limited["paged_max_concurrency"] < 64
    assert concurrency_cap_warning(limited) is None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny_models import tiny_model_dir
    return tiny_model_dir(tmp_path_factory.mktemp("kv") / "m", 256)


@pytest.mark.parametrize("argv, warned", [
    (["--num-requests", "3", "--prompt-lens", "8", "16", "--output-lens", "2", "4"], True),
    (["--num-requests", "40", "--prompt-lens", "40", "60", "--output-lens", "20", "30", "--kv-budget-tokens", "512",
      "--reserve-len", "128", "--block-size", "8"], False),
])
def test_bench_kv_cli_warns_on_stderr_only_when_capped(tiny_dir, capsys, argv, warned):
    assert main(["bench", "kv", "--model", str(tiny_dir), "--json", *argv]) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("warning: bench kv:")]
    assert len(lines) == (1 if warned else 0), err
    assert '"capped_by_num_requests": ' + ("true" if warned else "false") in out


# ----------------------------------------------------------------------------------------- repeats' spread

def test_spread_is_max_over_min_of_the_usable_values():
    assert spread([2.0, 3.0, 2.5]) == 1.5
    assert spread([4.0]) == 1.0 and spread([]) == 1.0
    assert spread([0.0, float("nan"), 2.0, 2.2]) == pytest.approx(1.1)     # a zero or NaN run is not a repeat


def test_spread_warns_on_disagreeing_repeats():
    series = {"decode ms/token, auto": [10.0, 10.4, 10.1], "decode ms/token, int8": [8.0, 12.0]}
    text = spread_warning(series)
    assert text.startswith(f"repeats disagree by 50% (> {round(100 * (MAX_SPREAD - 1))}%): the machine is busy; "
                           "ratios measured side by side still hold, absolute times do not")
    assert "int8" in text and "auto" not in text            # the widest measurement is named


def test_spread_stays_quiet_on_agreeing_repeats():
    assert spread_warning({"a": [10.0, 10.5, 11.0], "b": [3.0, 3.3]}) is None
    assert spread_warning({"a": [10.0, 10.0 * MAX_SPREAD]}) is None           # the limit itself still agrees
    assert spread_warning({"one run": [5.0], "none": []}) is None             # nothing repeated, nothing to say


def test_warn_if_repeats_disagree_prints_one_line():
    err = io.StringIO()
    assert warn_if_repeats_disagree("prefix", {"x": [1.0, 2.0]}, file=err)
    assert err.getvalue().startswith("warning: bench prefix: repeats disagree by 100%") and \
        err.getvalue().count("\n") == 1
    quiet = io.StringIO()
    assert warn_if_repeats_disagree("prefix", {"x": [1.0, 1.01]}, file=quiet) is None and quiet.getvalue() == ""


def test_repeating_benches_report_their_repeats():
    """prefix on a tiny model: each configuration's runs are kept for the spread check (values, not timings)."""
    from minillm.bench.prefix import PATTERNS, prefix_bench
    from minillm.testing import random_model, tiny_tokenizer
    from tests.tiny_models import TEMPLATE
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    r = prefix_bench(random_model(seed=1, layers=1, vocab=tok.vocab_size, max_pos=2048), tok,
                     EngineConfig.from_kwargs(num_blocks=512, block_size=8), repeats=2)
    assert len(r["repeats"]) == 2 * len(PATTERNS)
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in r["repeats"].values())


@pytest.mark.parametrize("name, flag", [(name, FLAGS[d].names[0]) for name, b in BENCHES.items() for d in b.flags
                                        if FLAGS[d].kwargs.get("type") is int])
def test_every_count_flag_below_one_is_refused_before_the_model_loads(name, flag, capsys, monkeypatch):
    """Every integer flag a bench reads (the registry's, so a new one is covered) refuses 0 before anything loads
    (-1 where 0 means something: no busy processes, the first seed)."""
    import minillm.loading.loader as loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the flag was checked")
    monkeypatch.setattr(loader, "load_model", no_load)
    dest = next(d for d in FLAGS if FLAGS[d].names[0] == flag)
    lo = 0 if dest in ZERO_OK else 1
    values = [str(lo + 3), str(lo - 1)] if FLAGS[dest].kwargs.get("nargs") == 2 else [str(lo - 1)]
    assert main(["bench", name, flag, *values]) == 2
    assert f"{flag} must be at least {lo}" in capsys.readouterr().err
