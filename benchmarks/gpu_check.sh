#!/usr/bin/env bash
# The GPU check: what calm does on a CUDA machine, in one prepared run of under 10 minutes.
#
#     bash benchmarks/gpu_check.sh                 # writes benchmarks/results/gpu_check.json
#     CALM_GPU_CHECK_OUT=DIR bash benchmarks/gpu_check.sh
#
# Steps, each recorded with its exit status, wall time and last line (a step that needs
# what this machine lacks is recorded as skipped, with one line saying why):
#   1. the machine: nvidia-smi, torch's CUDA, onnxruntime's providers, tensorrt;
#   2. onnxruntime-gpu (and tensorrt) installed where the package index is reachable and
#      they are missing (CALM_GPU_CHECK_INSTALL=0 skips this);
#   3. calm fit ts on CUDA in bfloat16 (--device cuda --dtype bfloat16), and on the CPU in
#      float32 beside it;
#   4. calm-export --dtype fp16 validated on the CUDA provider (--device cuda);
#   5. calm-export --format tensorrt --dtype fp16 (a TensorRT plan, validated like it);
#   6. decode latency per token of the fp16 engine on CUDA (calm generate, 64 tokens).
# The parity of each engine with the torch reference is its manifest's validation.
#
# The model is CALM_GPU_CHECK_MODEL (default smollm2-135m-instruct, installed when missing),
# the data CALM_GPU_CHECK_DATA (default arc-easy) and CALM_GPU_CHECK_LIMIT questions of it
# (default 200); CALM_GPU_CHECK_REFERENCE=SPEC fits DACA against SPEC instead of labeled
# temperature scaling. Without a GPU every GPU step is skipped and the rest still runs: that is
# how tests/benchmarks/test_gpu_check.py runs it on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${CALM_GPU_CHECK_PYTHON:-python}"
CALM="$PY -m calm_runtime.cli.main"
EXPORT="$CALM export"
OUT="${CALM_GPU_CHECK_OUT:-$ROOT/benchmarks/results}"
MODEL="${CALM_GPU_CHECK_MODEL:-smollm2-135m-instruct}"
DATA="${CALM_GPU_CHECK_DATA:-arc-easy}"
LIMIT="${CALM_GPU_CHECK_LIMIT:-200}"
# the fit: labeled temperature scaling, or (CALM_GPU_CHECK_REFERENCE=SPEC) DACA against SPEC
FIT=(ts)
[ -n "${CALM_GPU_CHECK_REFERENCE:-}" ] && FIT=(daca --reference "$CALM_GPU_CHECK_REFERENCE")
WORK="$(mktemp -d "${TMPDIR:-/tmp}/calm-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
STEPS="$WORK/steps.jsonl"
: > "$STEPS"

record() {  # NAME STATUS SECONDS DETAIL
    "$PY" - "$STEPS" "$1" "$2" "$3" "$4" <<'PY'
import json, sys
path, name, status, seconds, detail = sys.argv[1:]
with open(path, "a") as sink:
    sink.write(json.dumps({"step": name, "status": status, "seconds": float(seconds),
                           "detail": detail[-400:]}) + "\n")
PY
    echo "gpu_check: $1: $2 ($3 s) ${4:0:200}"
}

step() {  # NAME COMMAND...: run, record ok or failed with the last line of its output
    local name="$1" start end code
    shift
    start=$(date +%s%N)
    "$@" > "$WORK/$name.log" 2>&1
    code=$?
    end=$(date +%s%N)
    local ms=$(( (end - start) / 1000000 ))
    local seconds
    seconds=$(printf '%d.%03d' $(( ms / 1000 )) $(( ms % 1000 )))
    if [ "$code" = 0 ]; then
        record "$name" ok "$seconds" "$(tail -1 "$WORK/$name.log")"
    else
        record "$name" "failed (exit $code)" "$seconds" "$(grep -v '^\s*$' "$WORK/$name.log" | tail -1)"
    fi
    return "$code"
}

skip() {  # NAME WHY
    record "$1" skipped 0 "$2"
}

# ---- 1. the machine -----------------------------------------------------------------------
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if command -v nvidia-smi > /dev/null; then
    step machine nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
    skip machine "no nvidia-smi on this machine"
fi

# ---- 2. the GPU packages --------------------------------------------------------------------
providers() {
    "$PY" -c "import onnxruntime as o; print(','.join(o.get_available_providers()))" 2>/dev/null
}
if [ "$CUDA" != 1 ]; then
    skip install-gpu-packages "torch sees no CUDA device"
elif providers | grep -q CUDAExecutionProvider; then
    record install-gpu-packages ok 0 "onnxruntime offers $(providers)"
elif [ "${CALM_GPU_CHECK_INSTALL:-1}" = 1 ]; then
    step install-gpu-packages bash -c "$PY -m pip uninstall -y -q onnxruntime && \
        $PY -m pip install -q onnxruntime-gpu && ($PY -m pip install -q tensorrt || true)"
else
    skip install-gpu-packages "onnxruntime has no CUDA provider and CALM_GPU_CHECK_INSTALL=0"
fi
ORT_CUDA=0
providers | grep -q CUDAExecutionProvider && ORT_CUDA=1
TRT=$("$PY" -c "import tensorrt; print(1)" 2>/dev/null || echo 0)

# ---- 3. fit on CUDA in bfloat16 ------------------------------------------------------------
if [ "$CUDA" = 1 ]; then
    step fit-cuda-bf16 $CALM fit "${FIT[@]}" --model "$MODEL" --data "$DATA" --limit "$LIMIT" \
        --dtype bfloat16 --device cuda --out "$WORK/adapter" -q
else
    skip fit-cuda-bf16 "torch sees no CUDA device"
fi
# the CPU fit at float32 beside it: the adapter the engines carry, and what bf16 is read against
step fit-cpu-fp32 $CALM fit "${FIT[@]}" --model "$MODEL" --data "$DATA" --limit "$LIMIT" \
    --dtype float32 --device cpu --out "$WORK/adapter-cpu" -q
ADAPTER="$WORK/adapter-cpu"
[ -d "$WORK/adapter" ] && ADAPTER="$WORK/adapter"

# ---- 4. fp16 engine validated on the CUDA provider -----------------------------------------
if [ "$ORT_CUDA" = 1 ] && [ -d "$ADAPTER" ]; then
    step export-fp16-cuda $EXPORT --model "$MODEL" --adapter "$ADAPTER" --out "$WORK/fp16" \
        --dtype fp16 --device cuda -q
else
    skip export-fp16-cuda "onnxruntime offers no CUDA provider here (or no adapter was fitted)"
fi

# ---- 5. TensorRT plan -------------------------------------------------------------------------
if [ "$TRT" = 1 ] && [ "$CUDA" = 1 ] && [ -d "$ADAPTER" ]; then
    step export-tensorrt $EXPORT --model "$MODEL" --adapter "$ADAPTER" --out "$WORK/trt" \
        --format tensorrt --dtype fp16 -q
else
    skip export-tensorrt "tensorrt is not importable or no CUDA device"
fi

# ---- 6. decode latency per token on CUDA ---------------------------------------------------
if [ -f "$WORK/fp16/calm_engine.json" ]; then
    step decode-cuda $CALM generate "$WORK/fp16" "Question: What gas do plants absorb from the air?\nAnswer:" \
        --max-new-tokens 64 --providers cuda,cpu --json
    cp "$WORK/decode-cuda.log" "$WORK/decode.json" 2>/dev/null
else
    skip decode-cuda "no fp16 engine was built on CUDA"
fi

# ---- the result file -------------------------------------------------------------------------
"$PY" - "$STEPS" "$WORK" "$OUT/gpu_check.json" "$MODEL" "$DATA" "$LIMIT" <<'PY'
import json, subprocess, sys
from pathlib import Path

steps_file, work, out, model, data, limit = sys.argv[1:]
work = Path(work)
steps = [json.loads(line) for line in open(steps_file)]
result = {"command": "bash benchmarks/gpu_check.sh", "model": model, "data": data,
          "limit": int(limit), "steps": steps, "engines": {}}
try:
    result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True).stdout.strip()
except OSError:
    result["commit"] = "unknown"
for name in ("fp16", "trt"):
    manifest = work / name / "calm_engine.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        result["engines"][name] = {"validation": m.get("validation"),
                                   "stages": m["export"].get("stages")}
for name in ("adapter", "adapter-cpu"):
    config = work / name / "calm_adapter.json"
    if config.is_file():
        a = json.loads(config.read_text())
        result.setdefault("fits", {})[name] = {
            "temperature": a.get("temperature"),
            "placement": (a.get("provenance") or {}).get("placement"),
            "calibration_split": (a.get("metrics") or {}).get("calibration_split")}
decode = work / "decode.json"
if decode.is_file():
    try:
        text = decode.read_text()
        result["decode"] = json.loads(text[text.index("{"):])
    except ValueError:
        pass
Path(out).write_text(json.dumps(result, indent=2) + "\n")
print(f"gpu_check: wrote {out}")
PY
