"""The engine's device setting, checked on a CPU (issue 31): what runs here without a GPU.

* `device="cpu"` given explicitly decodes exactly what the default does (greedy and seeded sampling).
* The setting is validated without torch; a CUDA layout with fewer GPUs than ranks is refused before anything loads.
* The device path of the runner (inputs packed into one buffer and moved in one copy, RoPE from a table) computes
  the CPU path's logits exactly, run on the CPU itself.
* CUDA graphs' padding (which captured size a batch replays) and their padded step, emulated eagerly on the CPU
  through the Triton kernel (interpreted): the same greedy tokens as the eager engine, padding rows writing only the
  spare block.
* A `meta`-device dry run: weights, KV pool, step inputs, attention metadata, logits and the sampler's tensors all
  land on the engine's device, and no op of a step mixes devices (a torch function mode watches every call: an index
  or a setting left on the host would be a hidden host-to-device copy per step on a GPU).

tests/test_cuda_engine.py runs the same engine on a real GPU (skipped here).
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from minillm.config import EngineConfig
from minillm.distributed.device import check_gpu_count, dist_backend, resolve_device
from minillm.engine.llm_engine import LLMEngine
from minillm.kernels.triton_launch import kernel_device
from minillm.kernels.triton_paged_attention import paged_attention_decode_kernel
from minillm.kv.cache import KVCache
from minillm.layers.attention import TritonAttentionBackend
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import Sampler, SamplingBatch, draw
from minillm.testing import random_model
from minillm.worker.cuda_graphs import CudaGraphs, capture_sizes, padded_size
from minillm.worker.model_runner import ModelRunner, StepInputs

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 5, [11], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
# the Triton backend on CPU tensors: its kernel interpreted (tests/conftest.py sets TRITON_INTERPRET=1)
INTERPRETED = pytest.mark.skipif(kernel_device(paged_attention_decode_kernel) != "cpu",
                                 reason="the Triton kernel is compiled here (it takes CUDA tensors): "
                                        "tests/test_cuda_engine.py runs the graphs on the GPU")


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(p, sp, request_id=str(i))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


MIXED = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
         SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
         SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=10, ignore_eos=True)]


# --------------------------------------------------------------------------- the setting


def test_explicit_cpu_decodes_what_the_default_does():
    if resolve_device(EngineConfig().device).type != "cpu":
        pytest.skip("the default device is not the CPU here: tests/test_cuda_engine.py compares CUDA with the CPU")
    default = LLMEngine.from_model(random_model(4), None, num_blocks=64, block_size=4)
    explicit = LLMEngine.from_model(random_model(4), None, num_blocks=64, block_size=4, device="cpu")
    assert default.device == explicit.device == torch.device("cpu")     # no GPU here: auto is the CPU
    assert explicit.kv_cache.k.device.type == "cpu" and explicit.runner.cuda_graphs is None
    a, b = _run(default, MIXED), _run(explicit, MIXED)
    assert a == b and len(a) == 4 and all(len(t) == 10 for t in a.values())


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:7", "meta"])
def test_device_values_are_accepted(value):
    assert EngineConfig.from_kwargs(device=value).device == value


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda:01", "", None, 0, "mps"])
def test_a_bad_device_names_the_valid_ones(value):
    with pytest.raises(ValueError, match=r"unknown device .*use one of auto, cpu, cuda, cuda:N, meta"):
        EngineConfig.from_kwargs(device=value)


def test_the_default_device_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("MINILLM_DEVICE", raising=False)
    assert EngineConfig().device == "auto"
    monkeypatch.setenv("MINILLM_DEVICE", "CUDA:1")
    assert EngineConfig().device == "cuda:1" and EngineConfig.from_kwargs(device="cpu").device == "cpu"
    monkeypatch.setenv("MINILLM_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"unknown device 'gpu' \(the environment's MINILLM_DEVICE\)"):
        EngineConfig()


def test_enforce_eager_is_a_flag():
    assert EngineConfig.from_kwargs(enforce_eager=True).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig.from_kwargs(enforce_eager="yes")


def test_resolving_a_device():
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda", 0)
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)       # rank 3 of a parallel engine
    assert resolve_device("cuda:2", local_rank=3) == torch.device("cuda", 2)
    assert resolve_device("meta") == torch.device("meta")
    assert dist_backend(torch.device("cuda", 1)) == "nccl" and dist_backend(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("world, gpus, device, needle", [
    (2, 1, "cuda", r"2 ranks on device 'cuda' need 2 GPUs \(one per rank\), but torch sees 1 GPU:"),
    (3, 0, "cuda", r"3 ranks on device 'cuda' need 3 GPUs \(one per rank\), but torch sees no GPU"),
    (1, 0, "cuda", "needs a CUDA GPU, but torch sees none"),
    (2, 4, "cuda:0", "pins one GPU"),
    (1, 2, "cuda:2", r"torch sees 2 GPUs \(cuda:0 .. cuda:1\)"),
])
def test_fewer_gpus_than_ranks_is_refused(world, gpus, device, needle):
    with pytest.raises(ValueError, match=needle):
        check_gpu_count(world, gpus, device)


@pytest.mark.parametrize("world, gpus, device", [(1, 1, "cuda"), (2, 2, "cuda"), (2, 8, "cuda"), (1, 2, "cuda:1")])
def test_enough_gpus_pass(world, gpus, device):
    check_gpu_count(world, gpus, device)


def test_a_cuda_engine_without_a_gpu_is_refused_before_anything_starts(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from minillm.executor.launch import start_engine
    from minillm.testing import save_model_dir
    path = save_model_dir(random_model(3, vocab=302), tmp_path / "tiny")
    for world in (1, 2):
        with pytest.raises(ValueError, match="GPU"):
            start_engine(str(path), EngineConfig.from_kwargs(device="cuda", tensor_parallel_size=world,
                                                             distributed_executor_backend="thread"))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        LLMEngine.from_model(random_model(0), None, num_blocks=8, device="cuda")


# --------------------------------------------------------------------------- CUDA graphs' batch sizes


def test_captured_sizes_follow_the_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(65) == [1, 2, 4, *range(8, 73, 8)]
    assert capture_sizes(10_000)[-1] == 512
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (63, 64), (64, 64),
                                     (65, None), (0, None)])
def test_a_batch_replays_the_smallest_captured_size_that_holds_it(n, want):
    assert padded_size(n, capture_sizes(64)) == want


# --------------------------------------------------------------------------- the device path, run on the CPU


def _decode_inputs() -> StepInputs:
    """A mixed step: a 3-token prefill chunk, two decode rows and a 2-token verification (rows 0..6)."""
    return StepInputs(torch.tensor([5, 6, 7, 8, 9, 10, 11]), torch.tensor([4, 5, 6, 9, 2, 7, 8]), [3, 1, 1, 2],
                      [7, 10, 3, 9], torch.tensor([12, 13, 14, 21, 34, 43, 44]), [[1, 3], [2, 5, 4], [8], [7, 10, 11]],
                      [], [2, 3, 4, 5, 6])


def test_step_inputs_move_in_one_buffer_and_describe_the_same_batch():
    inputs = _decode_inputs()
    moved, meta, rows = inputs.to_device(torch.device("cpu"), block_size=4)
    want = inputs.metadata(4)
    assert torch.equal(meta.block_tables, want.block_tables) and torch.equal(meta.slot_mapping, want.slot_mapping)
    assert (meta.query_lens, meta.seq_lens, meta.query_start) == (want.query_lens, want.seq_lens, want.query_start)
    d_rows, d_tables, d_lens = meta.decode_rows()        # filled in from the buffer, not built from lists
    w_rows, w_tables, w_lens = want.decode_rows()
    assert d_rows == w_rows == [3, 4] and torch.equal(d_tables, w_tables) and torch.equal(d_lens, w_lens)
    assert torch.equal(meta.decode_row_index(), want.decode_row_index())
    assert rows.tolist() == inputs.sample_rows
    assert torch.equal(moved.input_ids, inputs.input_ids) and torch.equal(moved.positions, inputs.positions)
    # one buffer: every device tensor of the step is a view of the same storage
    ptrs = {t.untyped_storage().data_ptr() for t in (moved.input_ids, moved.positions, meta.slot_mapping,
                                                      meta.block_tables, rows, meta.decode_row_index())}
    assert len(ptrs) == 1


def test_the_device_path_computes_the_cpu_paths_logits():
    """The runner's path for a GPU (one packed copy, RoPE from a table, sample rows by a device index), run on the
    CPU, gives the CPU path's logits bit for bit on every step of a mixed workload."""
    engine = LLMEngine.from_model(random_model(4), None, num_blocks=64, block_size=4, attention_backend="torch",
                                  device="cpu")
    runner, plain = engine.runner, engine.runner.forward
    steps = []

    def both(inputs):
        k, v = engine.kv_cache.k.clone(), engine.kv_cache.v.clone()
        via_device = runner._device_forward(inputs)
        engine.kv_cache.k.copy_(k)
        engine.kv_cache.v.copy_(v)
        logits = plain(inputs)
        steps.append(torch.equal(via_device, logits))
        return logits
    runner.forward = both
    _run(engine, MIXED)
    assert len(steps) >= 10 and all(steps), steps


def _graph_engine(emulate: bool, pad_slot: int | None = None):
    engine = LLMEngine.from_model(random_model(4), None, num_blocks=32, block_size=4, attention_backend="triton",
                                  max_num_seqs=6, device="cpu")
    replays = []
    if emulate:
        r = engine.runner
        r.kv_cache = engine.kv_cache = KVCache(engine.model.kv_cfg, 32, 4, spare_blocks=1)
        graphs = r.cuda_graphs = CudaGraphs(engine.model, r.kv_cache, r.backend, capture_sizes(6), engine.max_model_len,
                                            emulate=True)
        if pad_slot is not None:
            graphs.pad_slot = pad_slot
        run = graphs.run

        def counted(inputs):
            hidden = run(inputs)
            replays.append(None if hidden is None else len(inputs.query_lens))
            return hidden
        graphs.run = counted
    return engine, replays


@INTERPRETED
def test_padded_graph_steps_decode_like_the_eager_engine():
    """CudaGraphs' step (static buffers, padding to the captured size, RoPE gathered from its table, the Triton
    kernel reading lengths and tables on the device) run eagerly on the CPU: the eager engine's greedy tokens, and
    the padding rows' K/V lands in the spare block only."""
    # lengths that end one by one: batches of 4, 3, 2, 1 (3 replays the size-4 step with a padding row)
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 6, 4, 3)]
    want = _run(_graph_engine(False)[0], greedy)
    engine, replays = _graph_engine(True)
    assert _run(engine, greedy) == want
    padded = [n for n in replays if n is not None]
    assert padded and any(padded_size(n, capture_sizes(6)) != n for n in padded)   # some steps ran padded
    spare = engine.kv_cache.k[:, :, 32 * 4:]
    assert spare.abs().sum() > 0                   # the padding rows wrote there ...
    # ... and nowhere else: padding that wrote into block 0 (a sequence's) changes what that sequence decodes
    engine, _ = _graph_engine(True, pad_slot=0)
    assert _run(engine, greedy) != want


# --------------------------------------------------------------------------- a meta-device dry run


class OneDevice(TorchFunctionMode):
    """Records every torch call whose tensor arguments sit on more than one device (a 0-dim CPU tensor, a scalar,
    excepted) and counts the calls that touched `device`."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device, self.mixed, self.calls = torch.device(device), [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                   and not (t.device.type == "cpu" and t.dim() == 0)}
        if self.device in devices:
            self.calls += 1
            if len(devices) > 1 and getattr(func, "__name__", "") not in ("to", "copy_"):   # the one transfer
                self.mixed.append((getattr(func, "__name__", str(func)), sorted(map(str, devices))))
        return func(*args, **kwargs)


decoded: list[int] = []


def _fake_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None):
    """The Triton kernel's signature, for a device that runs nothing (meta): the checks of what it is given."""
    assert {t.device.type for t in (q, k_cache, v_cache, block_tables, seq_lens)} == {"meta"}
    assert block_tables.shape[0] == seq_lens.shape[0] == q.shape[0]
    decoded.append(q.shape[0])
    return torch.empty_like(q)


@INTERPRETED
def test_a_meta_dry_run_places_every_tensor_of_a_step_on_the_engines_device(monkeypatch):
    import minillm.kernels.triton_paged_attention as kernel
    monkeypatch.setattr(kernel, "paged_attention_decode_triton", _fake_decode)   # the built-in backend's path
    decoded.clear()
    model = random_model(4)
    engine = LLMEngine.from_model(model, None, num_blocks=16, block_size=4, device="meta", attention_backend="triton")
    assert engine.device.type == "meta"
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert engine.kv_cache.k.device.type == engine.kv_cache.v.device.type == "meta"
    runner = ModelRunner(model, engine.kv_cache, TritonAttentionBackend())
    assert runner.device.type == "meta"
    steps = [  # a prefill of two sequences, their decode, a mixed step with a verification, a step with copies
        StepInputs(torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 3, 4, 0, 1]), [5, 2], [5, 2],
                   torch.tensor([4, 5, 6, 7, 8, 12, 13]), [[1, 2], [3]], [], [4, 6]),
        StepInputs(torch.tensor([8, 9]), torch.tensor([5, 2]), [1, 1], [6, 3], torch.tensor([9, 14]),
                   [[1, 2], [3]], [], [0, 1]),
        StepInputs(torch.tensor([10, 11, 12, 13]), torch.tensor([6, 3, 4, 5]), [1, 3], [7, 6],
                   torch.tensor([10, 15, 20, 21]), [[1, 2], [3, 5]], [(3, 6)], [0, 1, 2, 3]),
    ]
    mode = OneDevice("meta")
    with mode:
        for inputs in steps:
            logits = runner.execute(inputs)
            assert logits.device.type == "meta" and tuple(logits.shape) == (len(inputs.sample_rows), 128)
        # the sampler's per-row settings and noise follow the logits (greedy and random rows, penalties); its
        # processing (lab06's seam, which reads flags back to skip work) stands in as a plain temperature here
        params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01,
                                                               repetition_penalty=1.2, presence_penalty=0.5)]
        sampler = Sampler(process_fn=lambda lg, t, k, p, m: lg / t[:, None] + 0 * (k[:, None] + p[:, None] + m[:, None]))
        probs = sampler.probs(logits[:2], SamplingBatch(params, [None, None], [[1, 2], [3]], [[4], [5, 5]]))
        tokens = draw(probs, [None, None])
        assert probs.device.type == tokens.device.type == "meta"
    assert mode.calls > 100 and not mode.mixed, mode.mixed[:10]
    # the kernel ran in both layers of the decode step (2 rows) and of the mixed one (its 1 decode row)
    assert decoded == [2, 2, 1, 1], decoded


def test_the_device_check_sees_a_host_tensor_mixed_into_a_step():
    """The watcher above can fail: an index left on the host and used on the device's logits (torch takes it, and
    copies it over on every call)."""
    mode = OneDevice("meta")
    with mode:
        logits = torch.empty(2, 8, device="meta")
        _ = logits[torch.tensor([1, 0])]
    assert mode.mixed and mode.mixed[0][1] == ["cpu", "meta"]


# --------------------------------------------------------------------------- NCCL beside gloo


class _Group:
    """A process group that records which collectives it was asked for."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        def collective(*args, **kwargs):
            self.calls.append(name)
            return type("Work", (), {"wait": lambda self: None})()
        return collective


def test_host_tensors_go_over_the_gloo_group_beside_nccl():
    """A CUDA engine's Communicator holds an NCCL group and a gloo one: the step broadcast (a host buffer) and any
    other CPU tensor take gloo, device tensors NCCL; with one group (gloo on a CPU engine) everything takes it."""
    from minillm.distributed.comm import Communicator
    nccl, gloo = _Group(), _Group()
    comm = Communicator(nccl, rank=0, world_size=2, cpu_pg=gloo)
    comm.broadcast(torch.zeros(4, dtype=torch.int64))
    comm.all_reduce(torch.zeros(3))
    comm.all_reduce(torch.zeros(3, device="meta"))
    comm.send(torch.zeros(2, device="meta"), 1)
    comm.recv(torch.zeros(2), 1)
    assert gloo.calls == ["broadcast", "allreduce", "recv"] and nccl.calls == ["allreduce", "send"]
    only = _Group()
    cpu = Communicator(only, rank=0, world_size=2)
    cpu.broadcast(torch.zeros(4, dtype=torch.int64))
    cpu.all_reduce(torch.zeros(3))
    assert only.calls == ["broadcast", "allreduce"]


@INTERPRETED
def test_capture_and_replay_walk_every_size(monkeypatch):
    """capture() and run()'s replay path, with torch.cuda's graph API stood in for (no GPU here): a graph per size,
    largest first over one memory pool; a decode batch copies its inputs into the static buffers (padding rows in
    the spare block) and replays the size that holds it; a prefill or a batch past the largest size is not taken."""
    events = []

    class Graph:
        def pool(self):
            return "pool"

        def replay(self):
            events.append("replay")

    class Capture:
        def __init__(self, graph, pool=None):
            events.append(("capture", pool))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Event:
        def record(self):
            pass

        def synchronize(self):
            events.append("sync")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    engine = LLMEngine.from_model(random_model(4), None, num_blocks=32, block_size=4, attention_backend="triton",
                                  device="cpu")
    cache = KVCache(engine.model.kv_cfg, 32, 4, spare_blocks=1)
    graphs = CudaGraphs(engine.model, cache, engine.backend, capture_sizes(6), 64)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and events == [("capture", None)] + [("capture", "pool")] * 3
    decode = StepInputs(torch.tensor([5, 6, 7]), torch.tensor([3, 8, 1]), [1, 1, 1], [4, 9, 2],
                        torch.tensor([3, 20, 9]), [[0], [4, 5, 2], [2]], [], [0, 1, 2])
    hidden = graphs.run(decode)
    assert tuple(hidden.shape) == (3, engine.model.cfg.hidden_size) and events[-1] == "replay"
    assert graphs.buf[:4].tolist() == [5, 6, 7, 0] and graphs.lens[:4].tolist() == [4, 9, 2, 1]
    assert graphs.slots[:4].tolist() == [3, 20, 9, 32 * 4] and graphs.tables[1, :3].tolist() == [4, 5, 2]
    assert graphs.run(decode) is not None and "sync" in events       # the staging buffer waits for its last copy
    prefill = StepInputs(torch.tensor([5, 6]), torch.tensor([0, 1]), [2], [2], torch.tensor([0, 1]), [[0]], [], [1])
    assert graphs.run(prefill) is None
    many = StepInputs(torch.arange(9), torch.zeros(9, dtype=torch.long), [1] * 9, [1] * 9, torch.arange(9),
                      [[0]] * 9, [], list(range(9)))
    assert graphs.run(many) is None


def test_the_public_path_places_a_loaded_model_on_the_device(tmp_path):
    """LLM(...)'s path (executor.launch.start_engine: load, then the engine) with device="meta": the weights are read
    and land on the device, the pool is allocated there, and nothing stays on the host."""
    from minillm.executor.launch import start_engine
    from minillm.testing import save_model_dir
    path = save_model_dir(random_model(3, vocab=302), tmp_path / "tiny")
    for quantization in ("none", "int8"):      # float weights read straight onto it; quantized ones moved packed
        loaded, engine = start_engine(str(path), EngineConfig.from_kwargs(device="meta", quantization=quantization,
                                                                          num_blocks=8))
        tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
        assert tensors and {t.device.type for t in tensors} == {"meta"}, quantization
        assert engine.device.type == engine.kv_cache.k.device.type == "meta"
        if quantization == "int8":
            assert all(m.quant is not None and m.quant.qweight.device.type == "meta"
                       for n, m in loaded.model.quantizable() if "layers" in n)
