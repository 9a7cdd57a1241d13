#!/usr/bin/env bash
# The bundled drafts of the tiny DeepSeek-V3 (examples/tiny-deepseek-v3-eagle3-{mla,mha}, EAGLE-3, and
# examples/tiny-deepseek-v3-dflash, a DFlash block draft), end to end.
# Every step resumes where it stopped, so rerunning this script after an interruption continues the work.
#
#   bash scripts/tiny_drafts/make.sh            # needs work/tiny_target/ from scripts/tiny_target/build_data.py
#
# 1. the inputs: 2,048 training conversations (the first 1,024 of each half of conversations_train.jsonl) and
#    1,024 plain-text windows of the target's pretraining text, so the drafts also see raw-text contexts (trained
#    on chats alone they accepted far less on raw-text prompts)
# 2. eyas pipeline with examples/recipes/tiny-deepseek-v3-eagle3-mla.yaml: regenerate (the target's own greedy
#    answers) -> calibrate-vocab (the 2,048 most frequent loss tokens of 8,192) -> dump-hidden-states -> train
#    (2,000 steps, EAGLE-3.1 fc_norm + norm_output) -> eval; then the MHA and DFlash recipes, whose data stages are
#    the same and are skipped (stage 2 finds scripts/tiny_target/stage3-regenerated.jsonl's answers if it is
#    copied to work/drafts/regenerated.jsonl first)
# 3. copy the drafts into examples/ and evaluate them (and MTP, and the MLA draft in FP8) on the held-out prompts
set -euo pipefail
cd "$(dirname "$0")/../.."
W=work/drafts
SRC=work/tiny_target/conversations_train.jsonl
HALF=${HALF:-2020}                       # conversations in the first half of $SRC
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-1024}
mkdir -p $W

if [ ! -f $W/selected.jsonl ]; then
  # one pass (a `tail | head` pipe dies of SIGPIPE under pipefail)
  awk -v n="$NUM_CONVERSATIONS" -v half="$HALF" 'NR <= n || (NR > half && NR <= half + n)' $SRC > $W/selected.jsonl.tmp
  mv $W/selected.jsonl.tmp $W/selected.jsonl
fi
python scripts/tiny_drafts/text_records.py --num 1024 --tokens 384 -o $W/text.jsonl

eyas pipeline examples/recipes/tiny-deepseek-v3-eagle3-mla.yaml
eyas pipeline examples/recipes/tiny-deepseek-v3-eagle3-mha.yaml
eyas pipeline examples/recipes/tiny-deepseek-v3-dflash.yaml

rm -rf examples/tiny-deepseek-v3-eagle3-mla examples/tiny-deepseek-v3-eagle3-mha examples/tiny-deepseek-v3-dflash
cp -r $W/mla-2000/draft examples/tiny-deepseek-v3-eagle3-mla
cp -r $W/mha-2000/draft examples/tiny-deepseek-v3-eagle3-mha
cp -r $W/dflash-b8/draft examples/tiny-deepseek-v3-dflash
eyas eval examples/prompts/eval.jsonl --speculative-method mtp --out $W/eval-mtp.json
# the MLA draft quantized to FP8 blocks (weight-only), evaluated the same way
eyas quantize-draft --fp8 examples/tiny-deepseek-v3-eagle3-mla $W/mla-fp8
eyas eval examples/prompts/eval.jsonl --speculative-method eagle --draft-model $W/mla-fp8 --out $W/eval-mla-fp8.json
