#!/usr/bin/env bash
# A feature drafter (EAGLE-style: one OpenPangu decoder layer over the base model's features) for
# OpenPangu-Embedded-7B on one Ascend NPU: the same self-distilled answers as the Medusa recipe, the frozen bf16
# base run in every training step (a 7B model's features take 8 KB per token, too many to keep), soft targets
# over a 32k draft vocabulary, 6 draft levels; its per-level accuracy measured on the held-out split is saved
# with it for the runtime's choice. Then our engine drafts dynamic trees with it, and vLLM / vllm-ascend serve it
# as `"method": "eagle"` (README, "Serving with vLLM"). Adding `--aux_layers` (two layers at a third and two
# thirds of the depth) trains a fused drafter that accepts a little more in our engine but that vLLM cannot serve
# (train/demo_drafter/README.md); this recipe trains the one both run.
#   BASE=/models/openPangu-Embedded-7B bash train/train_feature_drafter_7b.sh
set -euo pipefail
BASE=${BASE:?set BASE to the OpenPangu-Embedded-7B directory}
export BASE DATA_DIR=${DATA_DIR:-data/pangu}
OUT=${OUT:-runs/openpangu-7b-feature-drafter}
cd "$(dirname "$0")/.."
bash train/distill_openpangu_7b.sh
source /usr/local/Ascend/ascend-toolkit/set_env.sh

python train/train_feature_drafter.py --base_model "$BASE" --device npu --online_features \
    --data "$DATA_DIR/sharegpt.jsonl" "$DATA_DIR/sharegpt_later.jsonl" "$DATA_DIR/humaneval.jsonl" --out "$OUT" \
    --levels 6 --draft_vocab_size 32768 --epochs 2 --lr 5e-4 --tokens_per_batch 16384 --max_length 2048
python train/medusa_tree_builder.py --base_model "$BASE" --device npu --heads "$OUT" \
    --data "$DATA_DIR/heldout.jsonl" --out "$OUT/tree.json" --nodes 32 --save_in_heads
python inference/convert_medusa.py --base_model "$BASE" --medusa_dir "$OUT" --layout vllm --out "$OUT-vllm"
echo "drafter: $OUT (vLLM eagle layout: $OUT-vllm)"
echo "run: python inference/medusa_generate.py --base_model $BASE --medusa_dir $OUT --device npu"
