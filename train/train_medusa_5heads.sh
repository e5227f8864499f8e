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
export BASE DATA_DIR=${DATA_DIR:-data/pangu}
OUT=${OUT:-runs/openpangu-7b-medusa-5heads}
cd "$(dirname "$0")/.."
bash train/distill_openpangu_7b.sh  # the self-distilled answers (DATA_DIR), shared with the feature drafter
source /usr/local/Ascend/ascend-toolkit/set_env.sh

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
