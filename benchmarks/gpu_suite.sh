#!/usr/bin/env bash
# The GPU proof in stages: each stage is one call on the GPU machine, finishes well inside
# 8 minutes on one H100 (a step that would overrun is stopped and recorded as timed out), and
# leaves exactly two files in OUTDIR: STAGE.tar.gz and STAGE.md (the summary, also printed).
# Unpacked at the repository root, the archive lands in benchmarks/results/<device>/<STAGE>/.
#
#   bash benchmarks/gpu_suite.sh --list                 the stages
#   bash benchmarks/gpu_suite.sh STAGE OUTDIR           run one stage (OUTDIR: created if absent)
#   bash benchmarks/gpu_suite.sh STAGE OUTDIR --dry-run print the stage's commands, run nothing
#   bash benchmarks/gpu_suite.sh STAGE --dry-run        the same (the seeds stage also prints its projected H100 time
#                                                       from a CPU dry run and fails if it overruns 8 minutes)
#   bash benchmarks/gpu_suite.sh STAGE OUTDIR --cpu     run it on the CPU at tiny size (to try the suite)
#   tar -xzf OUTDIR/STAGE.tar.gz                        at the repository root: the results in place
#
# Nothing is written outside OUTDIR: Python bytecode is off, and every cache (inductor, Triton,
# torch extensions, matplotlib, pip) and TMPDIR point into OUTDIR while the stage runs; they are
# removed before packing. Packages the machine lacks travel as wheels in .whl/ (see below) and
# are installed into OUTDIR too, per stage, never into the system environment.
#
# Wheels, prepared on a machine with network access, from the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       xformers==0.0.35 'flash-attn-4[cu13]==4.0.0b36' liger-kernel==0.8.5 --no-deps   (then the same for flash-attn-4's
#       dependencies: nvidia-cutlass-dsl, its libs, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops)
# (match --python-version to the GPU machine's python). flash-attn 2, FlashAttention-3 and Transformer
# Engine compile against torch and have no wheel to carry: their stages report them unavailable
# unless the machine has them. A failed wheel install is a row of every stage's summary.
#
# Environment: PYTHON (default python3), WHEELS (the wheel folder, default .whl), STAGE_BUDGET seconds for the whole stage (default 420),
# BENCH_ARGS extra arguments for the bench stages (default: --quick with --cpu, none on GPU).
set -uo pipefail

STAGES=(
  "env:versions, GPU, and the capability matrix as this machine sees it"
  "tests:the test files with GPU tests (attention, third-party backends, varlen, GIoU, KV cache, explain)"
  "parity-eager:fastzoo check vit_b16 + gpt2 with eager, bf16/fp16/fp32, kernel tables (--explain)"
  "parity-sdpa:sdpa automatic and each pinned kernel (flash, efficient, cudnn, math)"
  "parity-flex:flex (compiled on CUDA)"
  "parity-nested:nested (jagged NestedTensor SDPA)"
  "parity-varlen:varlen automatic and each impl (torch, flash, xformers, flex)"
  "parity-fa2:FlashAttention-2 (flash-attn)"
  "parity-fa3:FlashAttention-3 (flash_attn_interface, Hopper)"
  "parity-fa4:FlashAttention-4 (flash-attn-4, flash_attn.cute; Hopper / Blackwell)"
  "parity-te:Transformer Engine DotProductAttention"
  "parity-xformers:xFormers memory_efficient_attention"
  "bench-vit:ViT suite (benchmarks/run_all.py --only vit), eager rows"
  "bench-vit-compiled:ViT suite with torch.compile rows"
  "bench-gpt2:GPT-2 packed/padded suite (gpt2_varlen)"
  "bench-giou:GIoU loss suite"
  "bench-resnet:ResNet-50 suite"
  "deformable:multi-scale deformable attention: Triton kernel parity tests on the GPU, then its suite vs transformers"
  "parity-train:300 training steps per available backend vs the reference (loss curves)"
  "seeds:the seeds' tables: ViT-B/16 step per backend, GPT-2 padded vs packed, GIoU modes (benchmarks/seeds.py)"
)

usage() {
  echo "usage: bash benchmarks/gpu_suite.sh STAGE OUTDIR [--dry-run | --cpu], STAGE --dry-run   (or --list)" >&2
  echo "stages: $(printf '%s\n' "${STAGES[@]}" | cut -d: -f1 | tr '\n' ' ')" >&2
}

if [ "${1:-}" = "--list" ]; then
  printf '%s\n' "${STAGES[@]}" | awk -F: '{printf "%-20s %s\n", $1, substr($0, length($1) + 2)}'
  exit 0
fi
if [ $# -lt 2 ] || [ $# -gt 3 ]; then usage; exit 2; fi
STAGE=$1
OUTDIR=$2
MODE=${3:-gpu}
if [ $# -eq 2 ] && [ "$2" = "--dry-run" ]; then  # a dry run writes nothing: OUTDIR is a scratch folder
  MODE=--dry-run
  OUTDIR=$(mktemp -d)
  trap 'rm -rf "$OUTDIR"' EXIT
fi
case "$MODE" in gpu|--dry-run|--cpu) ;; *) echo "gpu_suite.sh: unknown option '$MODE' (--dry-run or --cpu)" >&2; usage; exit 2 ;; esac
if ! printf '%s\n' "${STAGES[@]}" | cut -d: -f1 | grep -qx -- "$STAGE"; then
  echo "gpu_suite.sh: unknown stage '$STAGE'" >&2; usage; exit 2
fi

OUTDIR=$(realpath -m -- "$OUTDIR")  # as the caller named it, before moving to the repository
cd "$(dirname "$0")/.."
REPO=$PWD
case "$OUTDIR/" in "$REPO/"*) echo "gpu_suite.sh: OUTDIR must be outside the repository (got $OUTDIR)" >&2; exit 2 ;; esac
mkdir -p "$OUTDIR" || { echo "gpu_suite.sh: cannot create OUTDIR '$OUTDIR'" >&2; exit 2; }
for f in "$OUTDIR/$STAGE.tar.gz" "$OUTDIR/$STAGE.md"; do
  [ -e "$f" ] && { echo "gpu_suite.sh: $f exists; give an empty OUTDIR or remove it" >&2; exit 2; }
done

PY=${PYTHON:-python3}
WORK="$OUTDIR/.$STAGE.work"  # removed before the stage ends
rm -rf "$WORK"
mkdir -p "$WORK/cache" "$WORK/tmp" "$WORK/results" "$WORK/logs"
export PYTHONDONTWRITEBYTECODE=1 TMPDIR="$WORK/tmp" XDG_CACHE_HOME="$WORK/cache" PIP_CACHE_DIR="$WORK/cache/pip" \
  TORCHINDUCTOR_CACHE_DIR="$WORK/cache/inductor" TRITON_CACHE_DIR="$WORK/cache/triton" \
  TORCH_EXTENSIONS_DIR="$WORK/cache/torch_extensions" MPLCONFIGDIR="$WORK/cache/matplotlib" HF_HOME="$WORK/cache/hf" \
  PYTEST_ADDOPTS="-p no:cacheprovider"
ROWS=()
STATUS=0
reason() {  # reason LOG: the line that says why a step failed (a refusal's own words before any table text)
  { grep -m1 -o 'unavailable: [^|]*' "$1" || grep -m1 -E '^[A-Za-z_.]*(Error|Exception)\b|^E  |FAILED|^ERROR' "$1" \
      || tail -n1 "$1"; } | cut -c1-200 | tr '|' '/'
}
WHEELS=${WHEELS:-.whl}
if [ "$MODE" != "--dry-run" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  t0=$SECONDS
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl >"$WORK/logs/install_wheels.log" 2>&1; then
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    ROWS+=("| install_wheels | ok: $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS/ | $((SECONDS - t0)) | logs/install_wheels.log |")
  else
    ROWS+=("| install_wheels | failed: $(reason "$WORK/logs/install_wheels.log") | $((SECONDS - t0)) | logs/install_wheels.log |")
    STATUS=1
  fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's fastzoo, not installed

if [ "$MODE" = "--cpu" ]; then
  DEV=cpu; SIZE=(--tiny); DTYPES_ALL="fp32"; DTYPES_HALF="fp32"; VIT=vit_s16
  BENCH=(${BENCH_ARGS---quick})
else
  DEV=cuda; SIZE=(); DTYPES_ALL="bf16 fp16 fp32"; DTYPES_HALF="bf16 fp16"; VIT=vit_b16
  BENCH=(${BENCH_ARGS-})
fi
if [ "$MODE" = "--dry-run" ]; then
  DEVICE_DIR="<device>"
else
  DEVICE_DIR=$("$PY" -c "from fastzoo.bench.harness import device_name; print(device_name('$DEV'))" 2>"$WORK/logs/device.log") \
    || { echo "gpu_suite.sh: cannot name the $DEV device (see below)" >&2; cat "$WORK/logs/device.log" >&2; rm -rf "$WORK"; exit 1; }
fi
RES="$WORK/results"
BUDGET=${STAGE_BUDGET:-420}
START=$SECONDS

step() {  # step NAME CMD...: run with what is left of the stage's budget; log in logs/NAME.log
  local name=$1; shift
  if [ "$MODE" = "--dry-run" ]; then printf '%s:' "$name"; printf ' %q' "$@"; echo; return; fi
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 15 ]; then ROWS+=("| $name | skipped: the stage's ${BUDGET} s budget is spent | 0 | |"); STATUS=1; return; fi
  local t0=$SECONDS rc
  timeout --kill-after=10 "$left" "$@" >"$WORK/logs/$name.log" 2>&1
  rc=$?
  local verdict="ok"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="timed out after ${left} s"; STATUS=1
  elif [ $rc -ne 0 ]; then verdict="failed (rc=$rc): $(reason "$WORK/logs/$name.log")"; STATUS=1
  fi
  ROWS+=("| $name | $verdict | $((SECONDS - t0)) | logs/$name.log |")
}

check() {  # check NAME DTYPES SPEC...: fastzoo check on ViT and GPT-2, with the kernel tables
  local name=$1 dtypes=$2; shift 2
  for model in "$VIT" gpt2; do
    for dtype in $dtypes; do
      step "${name}_${model}_${dtype}" "$PY" -m fastzoo.cli check "$model" "${SIZE[@]}" --device "$DEV" --dtype "$dtype" \
        --attn "$@" --explain --allow-fallback --json "$RES/parity_${name}_${model}_${dtype}.json"
    done
  done
}

bench() {  # bench SUITE [ARGS...]: one suite of benchmarks/run_all.py into the stage's results
  local suite=$1; shift
  step "bench_$suite" "$PY" benchmarks/run_all.py --device "$DEV" --only "$suite" --out "$RES" --no-progress "${BENCH[@]}" "$@"
}

case "$STAGE" in
  env)
    step environment "$PY" -c "
import importlib, json, platform, torch
info = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,
        'device': torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        'capability': list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None}
from importlib.metadata import version, PackageNotFoundError
for dist in ('triton', 'timm', 'transformers', 'xformers', 'flash-attn', 'flash-attn-4', 'nvidia-cutlass-dsl',
             'transformer-engine'):
    try:
        info[dist] = version(dist)
    except PackageNotFoundError:
        info[dist] = 'not installed'
for mod in ('xformers.ops', 'flash_attn.flash_attn_interface', 'flash_attn_interface', 'flash_attn.cute',
            'transformer_engine.pytorch'):  # what the backends import
    try:
        importlib.import_module(mod)
        info['import ' + mod] = 'ok'
    except Exception as e:
        info['import ' + mod] = f'fails ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else \"\"})'
json.dump(info, open('$RES/environment.json', 'w'), indent=2)
print(json.dumps(info, indent=2))"
    step matrix "$PY" -m fastzoo.cli list
    [ "$DEV" = cuda ] && step nvidia_smi nvidia-smi
    ;;
  tests)
    step pytest "$PY" -m pytest -q -rs --junitxml="$RES/pytest.xml" tests/test_attention.py tests/test_backends_thirdparty.py \
      tests/test_varlen.py tests/test_giou.py tests/test_kv_cache_contract.py tests/test_backend_contract.py tests/test_explain.py \
      tests/test_attention_gqa_window.py tests/test_flash_contract.py tests/test_kernel_declarations.py \
      tests/test_triton_giou_contract.py
    ;;
  parity-eager) check eager "$DTYPES_ALL" eager ;;
  parity-sdpa)
    check sdpa "$DTYPES_ALL" sdpa
    check sdpa_pinned "$DTYPES_HALF" sdpa:sdpa_backend=flash sdpa:sdpa_backend=efficient sdpa:sdpa_backend=cudnn \
      sdpa:sdpa_backend=math
    ;;
  parity-flex) check flex "$DTYPES_ALL" flex ;;
  parity-nested) check nested "$DTYPES_ALL" nested ;;
  parity-varlen)
    check varlen "$DTYPES_ALL" varlen
    check varlen_impls "$DTYPES_HALF" varlen:impl=torch varlen:impl=flash varlen:impl=xformers varlen:impl=flex
    ;;
  parity-fa2) check fa2 "$DTYPES_HALF" fa2 ;;
  parity-fa3) check fa3 "$DTYPES_HALF" fa3 ;;
  parity-fa4) check fa4 "$DTYPES_HALF" fa4 ;;
  parity-te) check te "$DTYPES_HALF" te ;;
  parity-xformers) check xformers "$DTYPES_ALL" xformers ;;
  bench-vit) bench vit --no-compile ;;
  bench-vit-compiled) bench vit --compile ;;
  bench-gpt2) bench gpt2_varlen ;;
  bench-giou) bench giou ;;
  bench-resnet) bench resnet50 ;;
  deformable)
    step pytest_deformable "$PY" -m pytest -q -rs --junitxml="$RES/pytest_deformable.xml" tests/test_deformable_attention.py
    bench deformable_attention
    ;;
  parity-train) bench parity_train ;;
  seeds)
    # one part per step (each its own budget line); fa2, fa3 and TE compile against torch and travel as no
    # wheel; xFormers and FA4 (nvidia-cutlass-dsl, ~92 MB: more than one call's 64 MiB, so carried in two
    # calls into the machine's kept build folder) come from $WHEELS when they are there, else their rows
    # say unavailable
    if [ "$MODE" = "--dry-run" ]; then
      "$PY" benchmarks/seeds.py --dry-run || STATUS=1
    fi
    for part in vit gpt2 giou; do
      step "seeds_$part" "$PY" benchmarks/seeds.py --part "$part" --device "$DEV" --out "$RES" --no-progress
    done
    ;;
esac

if [ "$MODE" = "--dry-run" ]; then rm -rf "$WORK"; exit $STATUS; fi

# pack: results + logs + summary under benchmarks/results/<device>/<stage>/, then only two files remain
DEST="$WORK/pack/benchmarks/results/$DEVICE_DIR/$STAGE"
mkdir -p "$DEST"
SUMMARY="$WORK/summary.md"
{
  echo "# gpu_suite stage \`$STAGE\` on $DEVICE_DIR ($DEV$( [ "$MODE" = "--cpu" ] && echo ', tiny sizes'))"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ); $((SECONDS - START)) s; status: $([ $STATUS -eq 0 ] && echo ok || echo 'FAILED (see the rows)')"
  echo
  echo "| step | result | seconds | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  if [ "$STAGE" = env ] && [ -f "$RES/environment.json" ]; then  # the versions every later stage ran with
    echo; echo '```json'; cat "$RES/environment.json"; echo; echo '```'
  fi
} >"$SUMMARY"
cp -r "$RES/." "$DEST/"
cp -r "$WORK/logs" "$DEST/logs"
cp "$SUMMARY" "$DEST/summary.md"
tar -czf "$OUTDIR/$STAGE.tar.gz" -C "$WORK/pack" benchmarks
cp "$SUMMARY" "$OUTDIR/$STAGE.md"
rm -rf "$WORK"
cat "$OUTDIR/$STAGE.md"
exit $STATUS
