#!/usr/bin/env bash
# The whole system end to end on a 2-GPU machine (nvidia-h200-x2), through the real `train`
# flow: the local Ray head rollflow starts on demand (it sees both GPUs),
# Prefect's ephemeral server, placement groups putting the trainer on GPU 0 and the embedded
# engine on GPU 1, weights over NCCL (`train.weight_sync=distributed`).
#
#   bash scripts/gpu/e2e.sh [a] [b] [c]      (default: all three; logs to $OUT or ./e2e-logs)
#   (a) the arithmetic main job (scripts/main.sh's steps: SFT warm start, then GRPO) with the
#       torch trainer, and with the megatron trainer too where megatron-core imports
#       (E2E_MEGATRON=0 skips it): held-out accuracy before/after
#   (b) GRPO on a Qwen2-0.5B-shaped random model, 4 steps: per-task time table
#   (c) the same colocated on one GPU (cluster.colocate; weights through Ray's object store,
#       since NCCL refuses two ranks on one GPU)
#   (d) the arithmetic GRPO with a megatron TP=2 train group on both GPUs, the engine colocated:
#       6 steps with a checkpoint every 3, the run's actors stopped, then the same run resumed
#       to 8 steps, its fresh group loading the TP=2 checkpoint (not run by default). The
#       resumed run's trainer is rebuilt at the checkpoint's version with nothing to replay.
#   (e) (d) for a tiny Qwen3-MoE (8 experts, 2 per token) with expert parallelism instead of
#       TP: a megatron EP=2 train group on both GPUs (4 experts each), its SFT warm start
#       (2 steps, torch trainer) first (not run by default).
#   (f) 4 GPUs (nvidia-h100-x4), disaggregated: (b)'s GRPO with a megatron TP=2 train group on
#       GPUs 0-1 and two embedded engines on GPUs 2 and 3 behind the real sglang-router
#       (rollout.use_router), weights over NCCL to both (`train.weight_sync=distributed`), 4
#       steps (not run by default). Its second table breaks each step's push down
#       (`broadcast_weights/push/*`: group set-up, the collective export, the first bucket's
#       broadcast with NCCL's communicator set-up, the engines' apply).
#   (g) 2 GPUs, colocated: (c)'s GRPO with a megatron TP=2 train group and two embedded engines,
#       one per GPU, weights as CUDA IPC handles (`train.weight_sync=tensor`), each engine's
#       entry serialized by the train rank on its own GPU (slime's layout; not run by default).
#   (h) bench.async_rl on 2 GPUs (trainer on GPU 0, engine on GPU 1): time to a held-out accuracy
#       in sync and async mode on the long-tailed addition task, its long answers 700 dots one
#       problem in ten (scored only with half of them or more: --reward tail), a 32-step warm
#       start, 24 sync and 30 async GRPO steps with the decoupled correction, a checkpoint every
#       3 steps scored on 1,000 held-out prompts after the runs, off their clocks (--offline-eval;
#       H_ARGS replaces the bench's arguments; not run by default). The last rows of
#       bench/RESULTS.md, "Async RL", scored 1,500 prompts: 525 s of a call's 600 once, and past
#       600 s once with a longer-tailed warm start. T_H, the part's limit, is 540 s, so the call
#       returns the log, each phase's seconds in it. It stops before the runs when the warm start
#       did not learn the long answers (bench.async_rl --min-tail).
#   (i) 2 GPUs, colocated: (g) with the torch trainer sharded by FSDP2 (`train.strategy=fsdp2`,
#       bf16 compute, fp32 master weights) over both GPUs, one embedded engine per GPU, weights
#       as CUDA IPC handles (not run by default; its CPU form, E2E_ARGS="--quick ...", runs two
#       gloo ranks and two CPU engines).
# scripts/gpu/e2e.py prints the tables from each run's stored metrics: seconds per task,
# weight-sync seconds, generation and training tokens/s, MFU. What each part measured, per
# run: bench/RESULTS.md, "GPU end to end".
# Packages the image lacks travel as .gpu_wheels/g/site.tar.xz (scripts/gpu/pack_site.sh:
# Ray, Prefect and their dependencies) plus any .gpu_wheels/*/megatron_core*.whl; E2E_WHEELS
# points elsewhere (e.g. when this runs from a snapshot of the repo). E2E_ARGS go to every
# e2e.py call (on a CPU: E2E_ARGS="--quick --steps 2 --prompts 4 --response-len 16").
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
export PREFECT_LOGGING_LEVEL=WARNING PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180
# short paths (Ray's socket paths are limited); the head's raylet passes this environment,
# the NCCL settings above included, to every Ray worker
export ROLLFLOW_HOME=${ROLLFLOW_HOME:-/tmp/rf-home} PREFECT_HOME=${PREFECT_HOME:-/tmp/rf-prefect}
export E2E_WORK=${E2E_WORK:-/tmp/rf-e2e}
LOG=$(realpath -m "${OUT:-e2e-logs}"); mkdir -p "$LOG"
PY=${PYTHON:-python3}
WHEELS=${E2E_WHEELS:-.gpu_wheels}
PARTS=${*:-a b c}
SITE=/tmp/site

# unpacked again when the pack changed (a warm machine keeps /tmp/site between calls)
STAMP=$SITE/.site-$(stat -c %s "$WHEELS/g/site.tar.xz" 2>/dev/null)
if [ -f "$WHEELS/g/site.tar.xz" ] && [ ! -f "$STAMP" ]; then
  rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf "$WHEELS/g/site.tar.xz" && touch "$STAMP" || exit 1
fi
MCORE=$(ls "$WHEELS"/*/megatron_core*.whl 2>/dev/null | head -n 1)
if [ -n "$MCORE" ] && [ ! -d "$SITE/megatron" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$MCORE"
fi
[ -d "$SITE" ] && export PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH || export PYTHONPATH=$PWD

nvidia-smi -L
$PY - <<'EOF' 2>&1 | tee "$LOG/env.log"
import importlib.util, torch, transformers, ray, prefect, pydantic
print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "transformers",
      transformers.__version__, "ray", ray.__version__, "prefect", prefect.__version__,
      "megatron-core", importlib.util.find_spec("megatron") is not None,
      "sglang-router", importlib.util.find_spec("sglang_router") is not None)
EOF
T0=$(date +%s)
$PY -m flows.cli cluster up > "$LOG/cluster.log" 2>&1
$PY -m flows.cli cluster status >> "$LOG/cluster.log" 2>&1; cat "$LOG/cluster.log"

run() {  # name, timeout (s), the runs it makes (comma-separated), e2e.py arguments...
  local name=$1 limit=$2 runs=$3; shift 3
  local t=$(date +%s)
  timeout "$limit" $PY scripts/gpu/e2e.py "$@" ${E2E_ARGS:-} > "$LOG/$name.log" 2>&1
  echo "== $name rc=$? ($(( $(date +%s) - t )) s): e2e.py $*" | tee -a "$LOG/summary.txt"
  grep -E "^ +(step|[0-9]+) \||^summary|^first push|^held-out|^SFT|Error|error:" "$LOG/$name.log" | tail -n 40 | tee -a "$LOG/summary.txt"
  # a failed run keeps its actors (and GPUs) for a rerun: free them for the next part
  for r in ${runs//,/ }; do $PY -m flows.cli runs stop "$r" >> "$LOG/cluster.log" 2>&1; done
}
for part in $PARTS; do
  case $part in
    a) run a_torch "${T_A:-330}" arithmetic-sft,arithmetic-grpo arithmetic
       if [ "${E2E_MEGATRON:-1}" != 0 ] && $PY -c 'import megatron.core' 2>/dev/null; then
         run a_megatron "${T_AM:-200}" arithmetic-grpo-megatron arithmetic --backend megatron
       fi ;;
    b) run b_qwen "${T_B:-240}" qwen2-grpo qwen ;;
    c) run c_colocate "${T_C:-240}" qwen2-grpo-colocate qwen --colocate ;;
    d) TP2=(--backend megatron --set train.tensor_parallel=2 --set cluster.actor_num_gpus_per_node=2
            --set cluster.colocate=true --set train.weight_sync=tensor --set train.save_interval=3)
       run d_tp2 "${T_D:-300}" arithmetic-grpo-megatron arithmetic "${TP2[@]}" --set rollout.num_rollout=6
       run d_tp2_resume "${T_D:-300}" arithmetic-grpo-megatron arithmetic "${TP2[@]}" --set rollout.num_rollout=8
       grep -hE "rebuilt|replayed|restored|checkpoint" "$LOG"/d_tp2_resume.log | head -n 5 ;;
    e) EP2=(--family qwen3_moe --sft-rollouts 2 --backend megatron --set train.expert_parallel=2
            --set cluster.actor_num_gpus_per_node=2 --set cluster.colocate=true
            --set train.weight_sync=tensor --set train.save_interval=3)
       run e_ep2 "${T_E:-300}" arithmetic-grpo-megatron-qwen3_moe arithmetic "${EP2[@]}" --set rollout.num_rollout=6
       run e_ep2_resume "${T_E:-300}" arithmetic-grpo-megatron-qwen3_moe arithmetic "${EP2[@]}" --set rollout.num_rollout=8
       grep -hE "rebuilt|replayed|restored|checkpoint" "$LOG"/e_ep2_resume.log | head -n 5 ;;
    f) TP2X2=(--backend megatron --run-name qwen2-grpo-tp2-2engines --set train.tensor_parallel=2
              --set cluster.actor_num_gpus_per_node=2 --set engine.num_engines=2
              --set cluster.rollout_num_gpus=2 --set rollout.use_router=true)
       run f_tp2_2engines "${T_F:-360}" qwen2-grpo-tp2-2engines qwen "${TP2X2[@]}" ;;
    g) TP2COLO=(--colocate --backend megatron --run-name qwen2-grpo-tp2-colocate
                --set train.tensor_parallel=2 --set cluster.actor_num_gpus_per_node=2
                --set engine.num_engines=2 --set cluster.rollout_num_gpus=2)
       run g_tp2_colocate "${T_G:-360}" qwen2-grpo-tp2-colocate qwen "${TP2COLO[@]}" ;;
    i) FSDP2COLO=(--colocate --run-name qwen2-grpo-fsdp2-colocate --set train.strategy=fsdp2
                  --set cluster.actor_num_gpus_per_node=2 --set engine.num_engines=2
                  --set cluster.rollout_num_gpus=2)
       run i_fsdp2_colocate "${T_I:-360}" qwen2-grpo-fsdp2-colocate qwen "${FSDP2COLO[@]}" ;;
    h) t=$(date +%s)
       timeout "${T_H:-540}" $PY -m bench.async_rl ${H_ARGS:---modes sync,async:2 --steps 24 --overlap-steps 30 --long-dots 700 --max-response-len 748 --sft-steps 32 --offline-eval --eval-every 3 --test-prompts 1000 --eval-prompts 1000 --set algorithm.rollout_correction.mode=decoupled} \
         > "$LOG/h_async.log" 2>&1
       echo "== h_async rc=$? ($(( $(date +%s) - t )) s)" | tee -a "$LOG/summary.txt"
       tail -n 12 "$LOG/h_async.log" | tee -a "$LOG/summary.txt" ;;
  esac
done
$PY -m flows.cli cluster status >> "$LOG/cluster.log" 2>&1
$PY -m flows.cli cluster down --force >> "$LOG/cluster.log" 2>&1
echo "e2e parts [$PARTS]: $(( $(date +%s) - T0 )) s" | tee -a "$LOG/summary.txt"
