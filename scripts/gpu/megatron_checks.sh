#!/usr/bin/env bash
# The megatron / NCCL GPU checks in one go, on a machine with 2 GPUs (logs to $OUT or ./gpu-logs):
#   A) GPU 0: tests/gpu/test_megatron_backend.py   |  GPU 1: bench torch, then megatron TP=1
#   B) both GPUs: TP=2 / PP=2 / DP=2 vs 1 GPU, and NCCL weight sync trainer -> engine
#   C) both GPUs: bench megatron TP=2
# Wheels for what the image lacks (megatron-core, pydantic, fastapi, uvicorn) may sit in
# .gpu_wheels/; they are installed into /tmp/site.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG=${OUT:-gpu-logs}; mkdir -p "$LOG"
PY=${PYTHON:-python3}
if ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi -L
$PY -c 'import torch, megatron.core as m; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "mcore", m.__version__)'
BENCH="-m bench.megatron_grpo --steps ${BENCH_STEPS:-4}"

(CUDA_VISIBLE_DEVICES=0 timeout ${T_A:-300} $PY -m pytest -q -p no:cacheprovider -rA tests/gpu/test_megatron_backend.py > "$LOG/a_backend.log" 2>&1; echo "A-tests rc=$?" >> "$LOG/a_backend.log") &
(export CUDA_VISIBLE_DEVICES=1; timeout ${T_A:-300} $PY $BENCH --backend torch > "$LOG/bench.log" 2>&1
 timeout ${T_A:-300} $PY $BENCH --backend megatron >> "$LOG/bench.log" 2>&1) &
wait
tail -n 30 "$LOG/a_backend.log"; grep '^{' "$LOG/bench.log"

timeout ${T_B:-420} $PY -m pytest -q -p no:cacheprovider -rA -s tests/gpu/test_megatron_parallel.py tests/gpu/test_nccl_weight_sync.py > "$LOG/b_parallel.log" 2>&1
echo "B rc=$?"; grep -E "nccl weight sync|passed|failed|Error|error" "$LOG/b_parallel.log" | tail -n 40

timeout ${T_C:-150} $PY -m torch.distributed.run --standalone --nproc-per-node=2 $BENCH --backend megatron --tp 2 >> "$LOG/bench.log" 2>&1
echo "C rc=$?"; grep '^{' "$LOG/bench.log"; tail -n 5 "$LOG/bench.log"
