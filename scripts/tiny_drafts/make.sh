#!/usr/bin/env bash
# The bundled EAGLE-3 drafts of the tiny DeepSeek-V3 (examples/tiny-deepseek-v3-eagle3-{mla,mha}), end to end.
# Every step resumes where it stopped, so rerunning this script after an interruption continues the work.
#
#   bash scripts/tiny_drafts/make.sh            # needs work/tiny_target/ from scripts/tiny_target/build_data.py
#
# 1. regenerate: the target's own greedy answers to the training conversations (two halves in parallel, one CPU
#    thread each; NUM_CONVERSATIONS of each half); plus 1,024 plain-text windows of the target's pretraining text,
#    so the drafts also see raw-text contexts (trained on chats alone they accepted far less on raw-text prompts)
# 2. calibrate-vocab: the 2,048 most frequent loss tokens of that data (of 8,192)
# 3. dump-hidden-states: the target's aux and last hidden states, once, for both drafts
# 4. train: the MLA and the MHA draft, offline, in parallel
# 5. copy both drafts into examples/ and evaluate them (and MTP, and the MLA draft in FP8) on the held-out prompts
set -euo pipefail
cd "$(dirname "$0")/../.."
W=work/drafts
SRC=work/tiny_target/conversations_train.jsonl
HALF=${HALF:-2020}                       # conversations in the first half of $SRC
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-1024}
MLA_STEPS=${MLA_STEPS:-4000}             # the shipped MLA draft; 1,600 steps gave AL 3.00 on the held-out prompts
MHA_STEPS=${MHA_STEPS:-4000}             # the shipped MHA draft; 1,600 steps gave AL 3.03
mkdir -p $W

tail -n +$((HALF + 1)) $SRC > $W/train_b.jsonl
regen="--max-new-tokens 192 --threads 1 --max-num-seqs 32 --chunk-size 32 --kv-cache-memory 2 --limit $NUM_CONVERSATIONS"
eyas regenerate $SRC $W/regenerated.jsonl $regen &
eyas regenerate $W/train_b.jsonl $W/regenerated_b.jsonl $regen &
wait
python scripts/tiny_drafts/text_records.py --num 1024 --tokens 384 -o $W/text.jsonl
cat $W/regenerated.jsonl $W/regenerated_b.jsonl $W/text.jsonl > $W/mixed.jsonl

eyas calibrate-vocab $W/mixed.jsonl --draft-vocab-size 2048 --max-length 512 -o $W/vocab-mixed.safetensors
eyas dump-hidden-states $W/mixed.jsonl $W/hidden-mixed --max-length 512 --threads 2

train="--hidden-states $W/hidden-mixed --vocab-file $W/vocab-mixed.safetensors --batch-size 8
       --max-length 512 --lr 1e-3 --warmup-steps 100 --save-every 100 --threads 1 --resume"
# the step count names the run: --resume refuses a checkpoint made with other settings
eyas train $train --max-steps $MLA_STEPS --draft-arch mla --out $W/mla-$MLA_STEPS > $W/train-mla-$MLA_STEPS.log 2>&1 &
eyas train $train --max-steps $MHA_STEPS --draft-arch mha --out $W/mha-$MHA_STEPS > $W/train-mha-$MHA_STEPS.log 2>&1 &
wait

rm -rf examples/tiny-deepseek-v3-eagle3-mla examples/tiny-deepseek-v3-eagle3-mha
cp -r $W/mla-$MLA_STEPS/draft examples/tiny-deepseek-v3-eagle3-mla
cp -r $W/mha-$MHA_STEPS/draft examples/tiny-deepseek-v3-eagle3-mha
for arch in mla mha; do
  eyas eval examples/prompts/eval.jsonl --speculative-method eagle \
    --draft-model examples/tiny-deepseek-v3-eagle3-$arch --out $W/eval-$arch.json
done
eyas eval examples/prompts/eval.jsonl --speculative-method mtp --out $W/eval-mtp.json
# the MLA draft quantized to FP8 blocks (weight-only), evaluated the same way
eyas quantize-draft --fp8 examples/tiny-deepseek-v3-eagle3-mla $W/mla-fp8
eyas eval examples/prompts/eval.jsonl --speculative-method eagle --draft-model $W/mla-fp8 --out $W/eval-mla-fp8.json
