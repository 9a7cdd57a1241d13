#!/usr/bin/env bash
# The bundled tiny DeepSeek-V3 (examples/tiny-deepseek-v3), stages 2 and 3, from stage 1 (1,200 steps on the
# standard library: the model bundled before the stage-3 one, kept in git history and restored from it here):
#
# Stage 2: continued pretraining on the standard library and the Python sources of the packages eyas installs,
#   half and half (plus the derived chat conversations, 20% of rows), 1,600 steps of 8 x 512 tokens on a fresh
#   cosine schedule (report: examples/reports/tiny-target-stage2.json; more greedy loops than before).
# Stage 3: sequence-level unlikelihood (scripts/tiny_target/unlikelihood.py) against those loops, beside the same
#   next-token loss: 120 steps of a 240-step schedule at learning rate 1e-4, weight 0.5
#   (report: examples/reports/tiny-target-stage3.json). This is the bundled model.
#
#   bash scripts/tiny_target/make.sh        # rerun after an interruption: every stage resumes or is skipped
#
# A further stage starts from the bundled model (train.py --init-from examples/tiny-deepseek-v3), and replaces it
# only together with drafts trained on it. The bundled model's answers to the drafts' 2,048 training conversations
# (scripts/tiny_drafts/make.sh's selected.jsonl, 192 new tokens each, `eyas regenerate` as the drafts' recipes run
# it) are committed as stage3-regenerated.jsonl: copied to work/drafts/regenerated.jsonl, the pipeline's regenerate
# stage finds every chunk done. The unlikelihood stage continues the model's own greedy outputs, so its run depends
# on the thread count's rounding: reruns land near the bundled model, not on it (it was trained with THREADS=2).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=work/tiny_target
THREADS=${THREADS:-1}
python scripts/tiny_target/build_data.py
STAGE1=f90c0e9   # the last commit that bundled the stage-1 model
mkdir -p $W/model $W/stage1
if [ ! -f $W/stage1/model.safetensors ]; then
  for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
    git show "$STAGE1:examples/tiny-deepseek-v3/$f" > $W/stage1/$f
  done
fi
python scripts/tiny_target/train.py --init-from $W/stage1 --out $W/model --lr 1e-3 --min-lr 5e-5 \
  --warmup 100 --max-steps 1600 --package-fraction 0.5 --ckpt-every 50 --eval-every 200 --threads "$THREADS"
cp examples/tiny-deepseek-v3/tokenizer.json examples/tiny-deepseek-v3/tokenizer_config.json $W/model/
python scripts/tiny_target/train.py --init-from $W/model --out $W/stage3/model --state $W/stage3 --max-steps 240 \
  --stop-at 120 --warmup 10 --lr 1e-4 --min-lr 1e-5 --package-fraction 0.5 --unlikelihood-weight 0.5 \
  --ul-round-steps 6 --eval-every 30 --ckpt-every 30 --snapshot-every 30 --threads "$THREADS"
cp examples/tiny-deepseek-v3/tokenizer.json examples/tiny-deepseek-v3/tokenizer_config.json $W/stage3/model/
[ -f $W/eval-start.json ] || python scripts/tiny_target/evaluate.py --model $W/stage1 --threads "$THREADS" --out $W/eval-start.json
python scripts/tiny_target/evaluate.py --model $W/model --threads "$THREADS" --out $W/eval-stage2.json
python scripts/tiny_target/evaluate.py --model $W/stage3/model --threads "$THREADS" --out $W/eval-stage3.json
