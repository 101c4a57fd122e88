#!/usr/bin/env bash
# The embedded engine's decode speed on one GPU (bench/RESULTS.md, "Embedded engine vs HF
# generate on a GPU"): the parts named (default: all four):
#   tests    tests/gpu's engine modules (Triton kernels, CUDA-graph turns, fp8)
#   kernels  bench.decode_kernels: each Triton kernel against the eager ops it replaces
#   profile  bench.gpu_decode without HTTP, Triton kernels off and on, kernels and host ops;
#            one engine direct, through its scheduler and over HTTP
#   bench    bench.generation over HTTP beside HF generate, 256 x 256, medians of 2
# Packages the image lacks: .gpu_wheels/g/site.tar.xz (scripts/gpu/pack_site.sh) and
# .gpu_wheels/*/megatron_core*.whl (tests/gpu skips without megatron-core); name .gpu_wheels
# in the run's `carry`. Logs go to $OUT (or gpu-logs/).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG=$(realpath -m "${OUT:-gpu-logs}"); mkdir -p "$LOG"
PY=${PYTHON:-python3}
PARTS=${*:-tests kernels profile bench}
source scripts/gpu/site_env.sh  # SITE=/tmp/site: the packages the image lacks
nvidia-smi -L
part() {  # name, timeout (s), command...
  local name=$1 limit=$2 t=$(date +%s); shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "== $name rc=$? ($(( $(date +%s) - t )) s)" | tee -a "$LOG/summary.txt"
}
part tests ${T_TESTS:-300} $PY -m pytest -q -p no:cacheprovider -rA tests/gpu/test_triton_decode.py \
  tests/gpu/test_cuda_graph_decode.py tests/gpu/test_fp8_engine.py
grep -E "passed|failed|error" "$LOG/tests.log" | tail -n 30
part kernels ${T_KERNELS:-200} $PY -m bench.decode_kernels
cat "$LOG/kernels.log" 2>/dev/null | grep -v "^Loading"
part profile ${T_PROFILE:-300} $PY -m bench.gpu_decode --compile off --triton off on --profile \
  --http --trace "$LOG" ${PROFILE_ARGS:-}
grep -E "tok/s|first generate|profiled" "$LOG/profile.log"
part bench ${T_BENCH:-500} $PY -m bench.generation --device cuda --model qwen2-0.5b --dtype bfloat16 \
  --batch-sizes 256 --new-tokens 256 --repeats 2 ${BENCH_ARGS:-}
tail -n 4 "$LOG/bench.log"
