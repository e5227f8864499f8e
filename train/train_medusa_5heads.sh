#!/usr/bin/env bash
# Medusa heads for OpenPangu-Embedded-7B on Ascend NPUs (8 x 910B by default), the documented recipe:
# self-distilled ShareGPT answers, 5 shared-lm_head heads, frozen bf16 base, DeepSpeed ZeRO-2.
#   BASE=/models/openPangu-Embedded-7B NPUS=8 bash train/train_medusa_5heads.sh
set -euo pipefail
BASE=${BASE:?set BASE to the OpenPangu-Embedded-7B directory}
NPUS=${NPUS:-8}
DATA=${DATA:-data/pangu_distill.jsonl}
HELDOUT=${HELDOUT:-data/pangu_heldout.jsonl}
OUT=${OUT:-runs/openpangu-7b-medusa-5heads}
cd "$(dirname "$0")/.."
source /usr/local/Ascend/ascend-toolkit/set_env.sh

python train/gen_distill_data.py --base_model "$BASE" --device npu --out "$DATA" --max_samples 20000 \
    --max_new_tokens 512 --batch_size 32 --no_think
python train/gen_distill_data.py --base_model "$BASE" --device npu --out "$HELDOUT" --skip 60000 \
    --max_samples 300 --max_new_tokens 512 --batch_size 32 --no_think
torchrun --nproc_per_node "$NPUS" train/train_medusa.py --base_model "$BASE" --device npu --data "$DATA" \
    --out "$OUT" --num_heads 5 --layout shared_lm_head --epochs 2 --lr 1e-3 --batch_size 4 --grad_accum 4 \
    --deepspeed train/deepspeed.json --resume
# --save_in_heads records the tree and the per-head accuracy that --medusa_choices auto chooses from
python train/medusa_tree_builder.py --base_model "$BASE" --device npu --heads "$OUT" --data "$HELDOUT" \
    --out "$OUT/tree.json" --save_in_heads
echo "heads: $OUT  tree: $OUT/tree.json"
echo "run: python inference/medusa_generate.py --base_model $BASE --medusa_dir $OUT --device npu"
