#!/usr/bin/env bash
# The self-distilled answers both OpenPangu-Embedded-7B recipes train on (train_medusa_5heads.sh,
# train_feature_drafter_7b.sh), on Ascend NPUs; reruns continue where a run stopped.
#   BASE=/models/openPangu-Embedded-7B DATA_DIR=data/pangu bash train/distill_openpangu_7b.sh
set -euo pipefail
BASE=${BASE:?set BASE to the OpenPangu-Embedded-7B directory}
DATA_DIR=${DATA_DIR:-data/pangu}
cd "$(dirname "$0")/.."
source /usr/local/Ascend/ascend-toolkit/set_env.sh
mkdir -p "$DATA_DIR"
distill() { python train/gen_distill_data.py --base_model "$BASE" --device npu --max_new_tokens 512 --batch_size 32 --no_think "$@"; }

# Training prompts: the ShareGPT conversations a human opens (the PyPI copy has 11,137 of them among ~17.7k),
# 0-10,799, the other human turns of those conversations (later-turn prompts 0-48,898 of 50,154), and HumanEval
# tasks 0-131. Held out, never trained on, for the tree: ShareGPT 10,800-11,136 and HumanEval 132-163.
distill --out "$DATA_DIR/sharegpt.jsonl" --stop 10800 --max_samples 20000
distill --out "$DATA_DIR/sharegpt_later.jsonl" --prompts sharegpt-later-turns --stop 48899 --max_samples 50000
distill --out "$DATA_DIR/humaneval.jsonl" --prompts humaneval --stop 132 --max_samples 132
distill --out "$DATA_DIR/heldout_sharegpt.jsonl" --skip 10800 --max_samples 300
distill --out "$DATA_DIR/heldout_humaneval.jsonl" --prompts humaneval --skip 132 --max_samples 32
cat "$DATA_DIR/heldout_sharegpt.jsonl" "$DATA_DIR/heldout_humaneval.jsonl" > "$DATA_DIR/heldout.jsonl"

