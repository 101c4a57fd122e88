#!/usr/bin/env bash
# A newcomer's first hour, scripted: a task of their own (not arithmetic) in a directory
# outside the repo, a config written from the README with relative paths, chat-message
# prompts in parquet under their own keys, their own reward file; a mistake in the config,
# fixed, and run again. It must finish with one whole run directory, no cluster restart.
#
#   bash scripts/newcomer_check.sh            # leaves the directory it used, and prints it
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bash "$repo/scripts/setup.sh"
export PATH="$repo/.venv/bin:$PATH" PREFECT_SERVER_ANALYTICS_ENABLED=false
export TOKENIZERS_PARALLELISM=false
work="$(mktemp -d /tmp/rollflow-newcomer.XXXX)"
cd "$work"
echo "== working in $work"

# The task: repeat the first letter of a word, three times ("cat" -> "ccc").
python - <<'EOF'
import random
import pyarrow as pa, pyarrow.parquet as pq
from examples.arithmetic.build_model import save_tiny_model

rng = random.Random(0)
letters = "abcdefghijklmnopqrstuvwxyz"
def rows(n):
    out = []
    for _ in range(n):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))
        out.append({"conversation": [{"role": "user", "content": f"first {word}"}],
                    "target": word[0] * 3})
    return out
import os; os.makedirs("data", exist_ok=True)
pq.write_table(pa.Table.from_pylist(rows(400)), "data/train.parquet")
pq.write_table(pa.Table.from_pylist(rows(50)), "data/test.parquet")
save_tiny_model("model", num_layers=2, hidden_size=64)
EOF

cat > letters_reward.py <<'EOF'
async def score(args, sample):
    """1 for the exact answer, partial credit for each right letter."""
    got, want = sample.response.strip()[:3], sample.label or ""
    return sum(a == b for a, b in zip(got, want)) / max(len(want), 1)
EOF

write_config() {  # $1: the eval set's path
cat > first-letter.yaml <<EOF
data:
  prompt_data: data/train.parquet
  input_key: conversation
  label_key: target
  apply_chat_template: true
rollout:
  num_rollout: 4
  rollout_batch_size: 16
  n_samples_per_prompt: 4
  max_response_len: 4
  custom_rm_path: letters_reward:score
  use_router: false
engine: {backend: embedded}
train: {backend: torch, model_path: model, lr: 1.0e-3, save_interval: 2}
storage: {uri: ./runs, run_name: first-letter}
eval:
  datasets:
    - {name: test, path: $1}
logging: {progress: false}
EOF
}

echo "== 1. a typo in the eval set's path: must fail at once, naming the key"
write_config data/tset.parquet
start=$(date +%s)
if rollflow train --config first-letter.yaml 2> err.txt; then
  echo "FAIL: a missing eval set was not reported"; exit 1
fi
echo "   failed after $(( $(date +%s) - start )) s; first line: $(head -n 1 err.txt)"
grep -q "tset.parquet" err.txt

echo "== 2. fixed, run again (same run name)"
write_config data/test.parquet
rollflow train --config first-letter.yaml
rollflow runs show first-letter

echo "== 3. the run directory is whole, here"
for part in config.yaml steps/000003/COMMITTED datasource checkpoints/LATEST eval; do
  test -e "runs/first-letter/$part" || { echo "FAIL: runs/first-letter/$part missing"; exit 1; }
done
rollflow cluster status
echo "OK: newcomer check passed in $work"
