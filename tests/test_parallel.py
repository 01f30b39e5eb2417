"""Tensor and pipeline parallelism: sharded = unsharded (logits and engine outputs), the sharding rules, one
broadcast per step, failures that stop everything with a clear error, and no process left behind."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.worker.model_runner import ModelRunner, StepInputs
from minillm.kv.cache import KVCache
from minillm.layers.attention import get_attention_backend
from minillm.loading.loader import build_model
from minillm.distributed.comm import on_threads, thread_communicators
from minillm.layers.linear import MEGATRON
from minillm.loading.export import hf_state
from minillm.distributed.sharding import check_tp_size, stage_layers, valid_tp_sizes
from minillm.executor.workers import WorkerError
from minillm.testing import random_model, save_model_dir
from tests.test_engine import run_engine


@pytest.fixture(autouse=True)
def nothing_left_running():
    """After every test here: no worker process, no rank thread."""
    yield
    deadline = time.monotonic() + 60                    # a hang guard: the loop ends as soon as all are gone
    while time.monotonic() < deadline and (multiprocessing.active_children() or _rank_threads()):
        time.sleep(0.1)
    assert multiprocessing.active_children() == [], "a worker process outlived its test"
    assert _rank_threads() == [], "a rank thread outlived its test"


def _rank_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("minillm-rank") and t.is_alive()]


def run_ranks(world: int, fn):
    """fn(rank, comm) on `world` thread ranks over real gloo; every rank's result, and the communicators."""
    comms = thread_communicators(world)

    def go(rank):
        try:
            return fn(rank, comms[rank])
        except BaseException:
            comms[rank].release()
            raise
    return on_threads(world, go), comms


def step_logits(model, inputs: StepInputs, comm=None):
    kv = KVCache(model.kv_cfg, 8, 8)
    return ModelRunner(model, kv, get_attention_backend("torch"), comm or model.comm).forward(inputs)


def prefill_inputs(seqs: list[list[int]]) -> StepInputs:
    ids, qlens, tables, slots, rows = [], [], [], [], []
    for i, s in enumerate(seqs):     # sequence i owns blocks 2i, 2i+1 (8 slots each)
        ids += s
        qlens.append(len(s))
        tables.append([2 * i, 2 * i + 1])
        slots += [16 * i + j for j in range(len(s))]
        rows += list(range(len(ids) - len(s), len(ids)))     # every position's logits
    pos = [j for s in seqs for j in range(len(s))]
    return StepInputs(torch.tensor(ids), torch.tensor(pos), qlens, list(qlens), torch.tensor(slots), tables, [], rows)


LAYOUTS = [  # (heads, kv_heads, tp, tie, vocab): even splits, KV replication, a vocabulary that does not divide
    (4, 2, 2, False, 128), (4, 2, 4, True, 101), (8, 8, 2, False, 97), (8, 8, 4, True, 128), (6, 3, 3, False, 100),
    (4, 1, 2, True, 64), (4, 1, 4, False, 130), (8, 2, 8, False, 128)]


@pytest.mark.parametrize("heads, kv_heads, tp, tie, vocab", LAYOUTS)
def test_tensor_parallel_logits_equal_single_rank(heads, kv_heads, tp, tie, vocab):
    full = random_model(seed=heads * 10 + tp, heads=heads, kv_heads=kv_heads, head_dim=8, layers=2, vocab=vocab,
                        tie=tie)
    inputs = prefill_inputs([[3, 9, 4, 1, 7, 7, 2], [5, 6, 8, 11, 12]])
    want = step_logits(full, inputs)
    state = list(hf_state(full))
    out, comms = run_ranks(tp, lambda r, c: step_logits(build_model(full.cfg, state, torch.float32, c), inputs))
    assert out[0].shape == want.shape and all(o is None for o in out[1:])
    assert (out[0] - want).abs().max().item() < 1e-4
    # 1 embedding all-reduce + 2 per layer, and one gather of the logits
    assert comms[0].stats.messages["all_reduce"] == 1 + 2 * full.cfg.num_layers
    assert comms[0].stats.bytes["all_reduce"] == (1 + 2 * 2) * inputs.input_ids.numel() * full.cfg.hidden_size * 4
    assert comms[0].stats.messages["gather"] == 1


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 2, 2), (4, 2, 4), (8, 2, 8), (6, 3, 3), (4, 1, 4)])
def test_each_rank_keeps_its_query_groups_kv_heads(heads, kv_heads, tp):
    group = heads // kv_heads
    for rank in range(tp):
        q = MEGATRON.column_rows(heads, 1, rank, tp)
        kv = MEGATRON.column_rows(kv_heads, 1, rank, tp)
        assert len(q) == heads // tp and len(kv) == max(1, kv_heads // tp)
        assert {h // group for h in q} == set(kv), f"rank {rank}: query heads {list(q)} need KV heads {set(kv)}"
    covered = sorted(h for r in range(tp) for h in MEGATRON.column_rows(heads, 1, r, tp))
    assert covered == list(range(heads))


def test_sharding_rules_and_valid_sizes():
    smollm = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64)
    assert valid_tp_sizes(smollm) == [1, 3]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot shard.*9 query heads.*Valid sizes: 1, 3"):
        check_tp_size(smollm, 2)
    with pytest.raises(ValueError, match="neither split over nor replicate"):
        MEGATRON.column_rows(3, 64, 0, 2)
    assert [list(stage_layers(30, 4, s)) for s in range(4)] == [list(range(0, 8)), list(range(8, 16)),
                                                                 list(range(16, 23)), list(range(23, 30))]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 30), st.integers(1, 5)), min_size=1, max_size=6),
       copies=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=3), data=st.data())
def test_step_inputs_survive_packing(seqs, copies, data):
    ids = [data.draw(st.integers(0, 10**6)) for q, _, _ in seqs for _ in range(q)]
    T = len(ids)
    rows = sorted(data.draw(st.sets(st.integers(0, T - 1), max_size=T)))
    inputs = StepInputs(torch.tensor(ids), torch.arange(T), [q for q, _, _ in seqs], [q + c for q, c, _ in seqs],
                        torch.arange(T) * 3, [list(range(n)) for _, _, n in seqs], copies, rows)
    back = StepInputs.unpack(inputs.pack())
    assert back.input_ids.tolist() == ids and back.positions.tolist() == list(range(T))
    assert (back.query_lens, back.seq_lens, back.block_tables, back.block_copies, back.sample_rows) == \
        (inputs.query_lens, inputs.seq_lens, inputs.block_tables, [tuple(c) for c in copies], rows)
    assert back.slot_mapping.tolist() == inputs.slot_mapping.tolist()


# --------------------------------------------------------------------------- the engine, sharded

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model = random_model(seed=3, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=302, tie=False)
    return model, save_model_dir(model, tmp_path_factory.mktemp("tiny"))


REQS = st.lists(st.tuples(st.lists(st.integers(3, 250), min_size=1, max_size=30), st.integers(1, 10)),
                min_size=1, max_size=5)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(pipeline_parallel_size=2, pipeline_micro_batches=3)],
                         ids=["tp2", "pp2", "pp2-mb3"])
def test_parallel_engine_equals_single_process(tiny_dir, layout):
    """Continuous batching, chunked prefill (a 12-token budget), preemption (a 14-block pool of 4 tokens) and prefix
    caching, with arrivals spread over steps: every request's greedy tokens equal the one-process engine's."""
    model, path = tiny_dir
    settings_ = dict(num_blocks=14, block_size=4, max_num_batched_tokens=12, max_num_seqs=4,
                     enable_prefix_caching=True)
    single = LLMEngine.from_model(model, **settings_)
    with LLM(str(path), distributed_executor_backend="thread", **layout, **settings_) as llm:
        engine = llm.engine
        preempted = []
        engine.add_step_observer(lambda info: preempted.extend(info.scheduler_output.preempted))

        @settings(max_examples=8, deadline=None, derandomize=True)
        @given(reqs=REQS, gaps=st.lists(st.integers(0, 2), min_size=5, max_size=5))
        def check(reqs, gaps):
            requests = [(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)) for p, m in reqs]
            arrivals = [sum(gaps[:i]) for i in range(len(requests))]
            assert run_engine(engine, requests, arrivals) == run_engine(single, requests, arrivals)
            assert engine.block_manager.num_free_blocks == 14
        check()
        crowd = [(list(range(10 * i + 3, 10 * i + 23)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                 for i in range(3)]      # 3 x 8 blocks of KV, 14 in the pool
        assert run_engine(engine, crowd) == run_engine(single, crowd)
        shared = [(list(range(3, 27)) + [100 + i], SamplingParams(temperature=0, max_tokens=4)) for i in range(3)]
        assert run_engine(engine, shared) == run_engine(single, shared)
        assert engine.block_manager.stats.hits > 0, "the shared prompt was meant to hit the prefix cache"
        assert preempted, "the small pool was meant to force preemption"


def test_one_broadcast_per_step_and_bytes_per_token(tiny_dir):
    model, path = tiny_dir
    with LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="thread") as llm:
        stats = llm.engine.runner.comm.stats
        stats.reset()
        steps = []
        llm.engine.add_step_observer(lambda info: steps.append(info))
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert stats.messages["broadcast"] == len(steps) == 6
        tokens = 3 + 5           # the prompt's prefill, then one decode token per step
        c = model.cfg
        assert stats.bytes["all_reduce"] == tokens * (2 * c.num_layers + 1) * c.hidden_size * 4


def test_bad_layouts_rejected_before_any_process(tiny_dir):
    _, path = tiny_dir
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot shard.*Valid sizes: 1, 2, 4"):
        LLM(str(path), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more stages than"):
        LLM(str(path), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="tensor and pipeline parallelism together"):
        LLM(str(path), tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="layer_skip"):
        LLM(str(path), tensor_parallel_size=2, speculative_config={"method": "layer_skip", "draft_layers": 1})
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(600)      # a hang guard, not a budget: the property is that the error stops the engine
def test_a_failing_thread_rank_stops_the_engine_with_a_clear_error(tiny_dir):
    _, path = tiny_dir

    class Faulty(type(MEGATRON)):
        def row_forward(self, x, weight, bias, comm):
            if comm.rank == 1 and x.shape[0] == 1:      # decode steps fail on rank 1
                raise RuntimeError("rank 1 broke")
            return super().row_forward(x, weight, bias, comm)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="thread", tp_rules=Faulty())
    with pytest.raises(WorkerError, match="minillm-rank1.*rank 1 broke.*Create a new LLM"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    with pytest.raises(WorkerError, match="shut down"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert not any(t.name.startswith("minillm-rank") and t.is_alive() for t in threading.enumerate())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_processes_equal_threads_and_leave_nothing_behind(tiny_dir):
    _, path = tiny_dir
    prompts = [[5, 6, 7, 8], list(range(10, 40))]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path)).generate(prompts, p, use_tqdm=False)]
    llm = LLM(str(path), tensor_parallel_size=2)
    pids = llm.engine.workers.pids
    assert len(pids) == 1 and _alive(pids[0])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] == want
    llm.close()
    assert not any(_alive(pid) for pid in pids) and multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_worker_killed_mid_step_raises_and_releases_everything(tiny_dir):
    _, path = tiny_dir
    llm = LLM(str(path), tensor_parallel_size=2)
    pid = llm.engine.workers.pids[0]
    llm.engine.add_step_observer(lambda info: os.kill(pid, signal.SIGKILL) if info.step == 2 else None)
    with pytest.raises(WorkerError, match=r"minillm-rank1 \(exit code -9\).*Create a new LLM"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert multiprocessing.active_children() == [] and not _alive(pid)


class BreaksOnRank1(type(MEGATRON)):
    """Module level, so a spawned worker can unpickle it: decode steps fail on rank 1."""
    def row_forward(self, x, weight, bias, comm):
        if comm.rank == 1 and x.shape[0] == 1:
            raise RuntimeError("rank 1 broke")
        return super().row_forward(x, weight, bias, comm)


@pytest.mark.slow
def test_a_failing_worker_process_is_reported_once(tiny_dir, capfd):
    """Rank 0's error names the rank, the cause and where it was raised; the worker prints no traceback of its own
    (it used to, beside gloo's 'Connection closed by peer' in rank 0's message)."""
    _, path = tiny_dir
    llm = LLM(str(path), tensor_parallel_size=2, tp_rules=BreaksOnRank1())
    with pytest.raises(WorkerError, match=r"rank 1: RuntimeError: rank 1 broke \(raised at .*test_parallel.py:\d+, "
                                          r"in row_forward\).*Create a new LLM") as e:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "collective error" not in str(e.value)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "rank 1 broke" not in err, err
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_workers_exit_when_rank0_dies(tiny_dir, tmp_path):
    _, path = tiny_dir
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from minillm import LLM
        if __name__ == "__main__":
            llm = LLM({str(path)!r}, tensor_parallel_size=2)
            print(*llm.engine.workers.pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    pids = [int(x) for x in proc.stdout.split()]
    assert proc.returncode == -signal.SIGKILL and pids, proc.stderr[-2000:]
    deadline = time.monotonic() + 60                    # a hang guard: the loop ends as soon as all are gone
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a worker outlived its rank 0"


@pytest.mark.slow
def test_two_nodes_through_torchrun_env_rendezvous(tiny_dir):
    """Two 'machines' on loopback: two torchrun agents (--nnodes 2, one process each) run the same CLI command;
    node 0's rank prints the tokens, which equal the single-process engine's."""
    from minillm.distributed.comm import free_port
    _, path = tiny_dir
    port = free_port()
    cmd = ["-m", "minillm", "generate", "ab", "--model", str(path), "--max-tokens", "10", "--temperature", "0",
           "--tensor-parallel-size", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(torchrun + ["--node-rank", str(r)] + cmd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [n.communicate(timeout=600) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    single = subprocess.run([sys.executable] + cmd[:-2], capture_output=True, text=True, env=env, timeout=600)
    assert single.returncode == 0, single.stderr[-2000:]
    assert outs[0][0] == single.stdout and outs[0][0].strip()
    assert outs[1][0].strip() == ""          # the worker rank prints nothing


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2)],
                         ids=["tp3", "pp2"])
def test_smollm_sharded_greedy_tokens_equal_one_process(layout, smollm_llm_outputs):
    prompts, params, want = smollm_llm_outputs
    with LLM("default", **layout) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.fixture(scope="module")
def smollm_llm_outputs():
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return prompts, params, [o.outputs[0].token_ids for o in LLM("default").generate(prompts, params,
                                                                                      use_tqdm=False)]


def test_bench_parallel_measures_what_the_formula_says(tiny_dir, tmp_path):
    from minillm.bench.parallel import format_parallel, parallel_plot, run_parallel_bench
    from minillm.config import EngineConfig
    model, path = tiny_dir
    cfg = model.cfg
    r = run_parallel_bench(str(path), EngineConfig.from_kwargs(distributed_executor_backend="thread"),
                           ("tp1", "tp2", "tp3", "pp2"), (1, 3), steps=3, prompt_len=5)
    assert "query heads do not split" in r["layouts"]["tp3"]["skipped"]
    h = cfg.hidden_size * 4
    assert r["layouts"]["tp2"]["formula_bytes_per_token"] == (2 * cfg.num_layers + 1) * h
    assert r["layouts"]["pp2"]["formula_bytes_per_token"] == h
    for name in ("tp2", "pp2"):
        for b in (1, 3):
            L = r["layouts"][name]
            assert L["by_batch"][b]["bytes_per_token"] == L["formula_bytes_per_token"], (name, b)
    assert r["layouts"]["tp1"]["by_batch"][1]["bytes_per_token"] == 0
    text = format_parallel(r)
    assert "tp2 step time vs tp1" in text and "skipped" in text
    parallel_plot(r, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_sampling_n_and_structured_outputs_work_sharded(tiny_dir):
    """Rank 0's sampler sees the same logits: seeded samples, n > 1 and a regex constraint give the one-process
    engine's outputs."""
    from minillm import StructuredOutputsParams
    model, path = tiny_dir
    reqs = [("ab", SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=8)),
            ("x", SamplingParams(temperature=0.8, seed=3, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex=r"(yes|no)-\d{2}")))]

    def texts(llm):
        return [[c.text for c in o.outputs] for o in llm.generate([p for p, _ in reqs], [q for _, q in reqs],
                                                                   use_tqdm=False)]
    want = texts(LLM(str(path)))
    with LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="thread") as llm:
        got = texts(llm)
    assert got == want
    import re
    assert re.fullmatch(r"(yes|no)-\d{2}", got[1][0])


@pytest.mark.slow
def test_gguf_partial_reads_equal_slices_of_the_whole_tensor():
    from minillm.loading.default_model import default_model_path
    from minillm.loading.gguf_file import GGUFFile
    from minillm.loading.sources import GGUFSource
    gf = GGUFFile.open(default_model_path())
    for name, rows, cols in [("blk.0.ffn_down.weight", None, slice(512, 1024)),       # Q4_1, whole blocks
                             ("blk.3.attn_output.weight", slice(64, 128), slice(200, 390)),  # not on blocks
                             ("blk.1.ffn_gate.weight", slice(512, 1024), None),
                             ("token_embd.weight", slice(16384, 32768), None)]:         # Q8_0
        src = GGUFSource(gf, name)
        whole = gf.load(name)
        assert torch.equal(src.read(rows=rows, cols=cols), whole[rows or slice(None), cols or slice(None)]), name


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_speculative_decoding_verifies_on_a_parallel_engine(tiny_dir, layout):
    """n-gram guesses verified by a sharded target: k + 1 rows per sequence gathered from the ranks; greedy tokens
    equal the plain one-process engine's."""
    model, path = tiny_dir
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 40)) * 2]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path)).generate(prompts, p, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(str(path), distributed_executor_backend="thread", speculative_config=spec, **layout) as llm:
        outs = llm.generate(prompts, p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0, "the prompts were meant to draft guesses"


def test_quantized_tensor_parallel_equals_quantized_one_process(tiny_dir):
    """int4 layers sharded over two ranks (rows of column-parallel layers, group-aligned columns of row-parallel
    ones, each rank quantizing its own slice) give the one-process int4 engine's greedy tokens."""
    import copy
    from minillm.quant.formats import QuantSpec
    model, path = tiny_dir
    twin = random_model(seed=3, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=302, tie=False)  # = tiny_dir's
    assert torch.equal(twin.layers[0].mlp.down_proj.weight, model.layers[0].mlp.down_proj.weight)
    single = LLMEngine.from_model(twin.quantize_(QuantSpec("int4", 32), QuantSpec("int8")))
    requests = [([5, 9, 33, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
                (list(range(40, 70)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]
    with LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="thread", quantization="int4") as llm:
        assert all(m.quant is not None for _, m in llm.engine.model.quantizable())
        assert run_engine(llm.engine, requests) == run_engine(single, requests)


@pytest.mark.slow      # ~3 s of thread ranks; the fast suite checks a worker's pool in test_kv_int8
def test_int8_kv_cache_on_a_tensor_parallel_engine_equals_one_process(tiny_dir):
    """kv_cache_dtype reaches the workers: each rank's int8 slice (its KV heads, their scales) gives the one-process
    int8 engine's greedy tokens (which differ from the float pool's here, so a float rank would show)."""
    model, path = tiny_dir
    requests = [([5, 9, 33, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
                (list(range(3, 23)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    single = run_engine(LLMEngine.from_model(model, kv_cache_dtype="int8"), requests)
    assert single != run_engine(LLMEngine.from_model(model), requests), "int8 should change a token here"
    with LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="thread", kv_cache_dtype="int8") as llm:
        assert llm.engine.kv_cache.quantized and llm.engine.workers.spec.config.cache.kv_cache_dtype == "int8"
        assert run_engine(llm.engine, requests) == single
