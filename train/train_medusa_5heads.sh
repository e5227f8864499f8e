#!/usr/bin/env bash
# Medusa heads for OpenPangu-Embedded-7B on Ascend NPUs (8 x 910B by default), the documented recipe:
# self-distilled ShareGPT + HumanEval answers, 5 sequentially dependent shared-lm_head heads (head i reads
# tokens t+1 .. t+1+i, the design that measured best on the demo model, train/demo_heads/README.md),
# soft targets (the base model's distributions), frozen bf16 base, DeepSpeed ZeRO-2, trained over a 32k draft
# vocabulary, and a tree chosen on a held-out split.
#   BASE=/models/openPangu-Embedded-7B NPUS=8 bash train/train_medusa_5heads.sh
set -euo pipefail
BASE=${BASE:?set BASE to the OpenPangu-Embedded-7B directory}
NPUS=${NPUS:-8}
DATA_DIR=${DATA_DIR:-data/pangu}
OUT=${OUT:-runs/openpangu-7b-medusa-5heads}
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

torchrun --nproc_per_node "$NPUS" train/train_medusa.py --base_model "$BASE" --device npu \
    --data "$DATA_DIR/sharegpt.jsonl" "$DATA_DIR/sharegpt_later.jsonl" "$DATA_DIR/humaneval.jsonl" --out "$OUT" --num_heads 5 \
    --layout shared_lm_head --head_input hidden_and_path --soft_targets --draft_vocab_size 32768 \
    --epochs 2 --lr 1e-3 --batch_size 4 --grad_accum 4 --deepspeed train/deepspeed.json --resume
# Trained and proposing over the 32k most frequent answer tokens, the heads' projection costs a fifth of the
# full one. --save_in_heads records a 32-node tree and the per-head accuracy that --medusa_choices auto chooses
# from on each machine (on an NPU a 16-64-token verification costs about one token, so auto takes large trees);
# auto verifies a dynamic tree of the size it chooses; the builder reports both trees' held-out tokens per step.
python train/medusa_tree_builder.py --base_model "$BASE" --device npu --heads "$OUT" \
    --data "$DATA_DIR/heldout.jsonl" --out "$OUT/tree.json" --nodes 32 --budgets 8,16,24,32,48,63 --save_in_heads
echo "heads: $OUT  tree: $OUT/tree.json"
echo "run: python inference/medusa_generate.py --base_model $BASE --medusa_dir $OUT --device npu"
