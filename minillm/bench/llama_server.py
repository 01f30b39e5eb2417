"""llama.cpp's `llama-server` as `bench throughput`'s peer: what a CPU user would run instead of minillm.

The server runs continuous batching over `slots` parallel sequences (sized like minillm's max_num_seqs), on the same
GGUF file and thread count. The workload goes to it as minillm gets it: the same token ids, greedy, EOS ignored so
every request produces exactly its drawn number of tokens, all sent at once. Its output tokens per second are
timed from the first send to the last token, as minillm's run is.
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx

from minillm.bench import serving
from minillm.bench.serving_metrics import request_metrics
from minillm.bench.throughput import EngineRun
from minillm.bench.workload import Request

START_TIMEOUT_S = 300.0                 # a hang guard: loading a small GGUF takes a second or two


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(binary: str, gguf: str | Path, threads: int, slots: int, slot_len: int, port: int) -> list[str]:
    """The server's command line: -np slots, each with slot_len tokens of context (-c is their sum), -cb, no prompt
    cache (each round is started cold, as each of minillm's rounds builds a new engine)."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-cb",
            "-c", str(slots * slot_len), "--no-cache-prompt", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]


@contextlib.contextmanager
def running(binary: str, gguf: str | Path, threads: int, slots: int, slot_len: int) -> Iterator[str]:
    """llama-server on a free port until the block ends; yields its /v1 URL once /health says it is ready."""
    port = _free_port()
    cmd = command(binary, gguf, threads, slots, slot_len, port)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}", " ".join(cmd))
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_ready(proc: subprocess.Popen, base: str, cmd: str) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = "".join(proc.stderr.readlines()[-8:]).strip() if proc.stderr else ""
            raise ValueError(f"llama-server exited with status {proc.returncode} before it was ready ({cmd}):\n{tail}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:     # 503 while the model loads
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise ValueError(f"llama-server was not ready after {START_TIMEOUT_S:.0f} s ({cmd})")


def timed_round(binary: str, gguf: str | Path, threads: int, slots: int, slot_len: int,
                workload: list[Request]) -> EngineRun:
    """One round on a server started for it (and warmed up): a server kept for a second round of 64 requests at
    once answered 27 of them and then nothing (the llama.cpp of llama-cpp-python 0.3.36, prompt cache on or off)."""
    with running(binary, gguf, threads, slots, slot_len) as url:
        model = serving.check_server(url, None)
        warm_up(url, model, workload)
        return run(url, model, workload)


def prompts_of(workload: list[Request]) -> list[serving.Prompt]:
    return [serving.Prompt(r.max_tokens, prompt_tokens=len(r.prompt_token_ids), token_ids=list(r.prompt_token_ids))
            for r in workload]


def run(url: str, model: str, workload: list[Request]) -> EngineRun:
    """The workload through the server, all sent at t0; refuses a run in which any request failed or stopped
    short of its length (a server that ignored ignore_eos would look faster than it is)."""
    prompts = prompts_of(workload)
    traces, elapsed = serving.run_workload(url, model, prompts)
    short = [(i, t.output_tokens, p.max_tokens) for i, (t, p) in enumerate(zip(traces, prompts))
             if not t.ok or t.output_tokens != p.max_tokens]
    if short:
        i, got, want = short[0]
        raise ValueError(f"llama-server answered {len(short)} of {len(prompts)} requests wrongly: request {i} gave "
                         f"{got} tokens of {want} ({traces[i].error or 'stopped early'})")
    run = EngineRun(sum(t.output_tokens for t in traces), elapsed)
    for t in traces:
        m = request_metrics(t)
        run.ttft_s.append(m.ttft)
        if m.tpot is not None:
            run.tpot_s.append(m.tpot)
    return run


def warm_up(url: str, model: str, workload: list[Request]) -> None:
    """Two short requests, so the first timed one does not pay for first-touch allocations."""
    short = [Request(r.prompt_token_ids[:16], 4) for r in workload[:2]]
    serving.run_workload(url, model, prompts_of(short))

