#!/usr/bin/env bash
# GPU proof in one call: install what was carried, run the GPU tests, the parity tables of every
# attention backend, and the benchmarks' GPU mode; write everything to $OUT (or ./gpu_results)
# and to benchmarks/results/<device>/.
#
# Written for a machine with CUDA, torch, triton, timm, transformers, safetensors, pyyaml and
# pytest preinstalled (Python 3.12) and no network. Packages it lacks travel as wheels in .whl/,
# prepared on a machine with network access, from the repository root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl xformers==0.0.35
#
# (add any other missing package the same way, one version each). flash-attn and FlashAttention-3
# have no binary wheel on PyPI and Transformer Engine's are far larger than what can be carried,
# so fa2/fa3/te are reported "unavailable" here unless the machine already has them.
#
# Usage:  bash benchmarks/gpu_suite.sh            (about 5-10 minutes on one H100/H200)
# Stages are independent: one failing stage is recorded and the next one still runs; the exit
# status is non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
status=0
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
run_stage() {  # run_stage NAME CMD...: output to $OUT/NAME.log, status to summary.txt
  local name=$1; shift
  log "$name: $*"
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then
    log "$name: ok ($((SECONDS - t0)) s)"
  else
    log "$name: FAILED rc=$? ($((SECONDS - t0)) s), see $name.log"; status=1
  fi
}

# 1. carried wheels into a private site directory, never into the system environment
if compgen -G ".whl/*.whl" >/dev/null; then
  run_stage install "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's fastzoo, without installing it

# 2. what this machine is: device, library versions, and the capability matrix as seen here
"$PY" - >"$OUT/environment.json" 2>"$OUT/environment.err" <<'EOF'
import importlib, json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None}
for mod in ("triton", "timm", "transformers", "xformers", "flash_attn", "flash_attn_interface", "transformer_engine"):
    try:
        info[mod] = getattr(importlib.import_module(mod), "__version__", "installed")
    except Exception as e:
        info[mod] = f"unavailable ({type(e).__name__})"
print(json.dumps(info, indent=2))
EOF
cat "$OUT/environment.json" | tee -a "$OUT/summary.txt"
DEVICE_DIR=$("$PY" -c "import torch; from fastzoo.bench.harness import device_name; print(device_name('cuda' if torch.cuda.is_available() else 'cpu'))")
RESULTS="benchmarks/results/$DEVICE_DIR"
mkdir -p "$RESULTS"
run_stage matrix "$PY" -m fastzoo.cli list

# 3. the test suite: GPU tests run, CPU tests still pass here
run_stage pytest "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/pytest.xml"

# 4. parity tables: every backend, each dtype it may take, for every model with attention
MODELS=$("$PY" -c "import fastzoo; print(' '.join(m for m in ('vit_b16', 'gpt2') if m in fastzoo.list_models()))")
for model in $MODELS; do
  for dtype in bf16 fp16 fp32; do
    run_stage "check_${model}_${dtype}" "$PY" -m fastzoo.cli check "$model" --device cuda --dtype "$dtype" \
      --attn all --json "$OUT/parity_${model}_${dtype}.json"
  done
  # sdpa's pinned kernels, named one by one (pinned kernels refuse rather than fall back)
  run_stage "check_${model}_sdpa_kernels" "$PY" -m fastzoo.cli check "$model" --device cuda --dtype bf16 \
    --attn sdpa:sdpa_backend=flash sdpa:sdpa_backend=efficient sdpa:sdpa_backend=cudnn sdpa:sdpa_backend=math \
    --json "$OUT/parity_${model}_sdpa_kernels.json"
done

# 5. the benchmarks' GPU mode, if this checkout has the bench harness
if [ -f benchmarks/run_all.py ]; then
  # --quick keeps the whole script inside one 10-minute call; BENCH_ARGS="" for the full sizes
  run_stage bench "$PY" benchmarks/run_all.py --device cuda ${BENCH_ARGS---quick}
else
  log "bench: skipped (benchmarks/run_all.py is not in this checkout)"
fi

cp "$OUT"/parity_*.json "$OUT/environment.json" "$OUT/summary.txt" "$RESULTS"/ 2>/dev/null
log "done: status $status; results in $OUT and $RESULTS"
exit $status
