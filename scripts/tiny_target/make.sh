#!/usr/bin/env bash
# The next tiny DeepSeek-V3, in two stages after examples/tiny-deepseek-v3 (1,200 steps on the standard library):
#
# Stage 2: continued pretraining on the standard library and the Python sources of the packages eyas installs,
#   half and half (plus the derived chat conversations, 20% of rows), 1,600 steps of 8 x 512 tokens on a fresh
#   cosine schedule (report: examples/reports/tiny-target-stage2.json; more greedy loops than before).
# Stage 3: sequence-level unlikelihood (scripts/tiny_target/unlikelihood.py) against those loops, beside the same
#   next-token loss: 120 steps of a 240-step schedule at learning rate 1e-4, weight 0.5
#   (report: examples/reports/tiny-target-stage3.json).
#
#   bash scripts/tiny_target/make.sh        # rerun after an interruption: every stage resumes or is skipped
#
# Stage 3's result is committed as scripts/tiny_target/stage3-model: the point a further stage starts from on a
# machine without work/ (train.py --init-from scripts/tiny_target/stage3-model). It replaces
# examples/tiny-deepseek-v3 only together with drafts trained on it. Its answers to the drafts' 2,048 training
# conversations (scripts/tiny_drafts/make.sh's selected.jsonl, 192 new tokens each, `eyas regenerate` as the drafts'
# recipes run it) are committed beside it as stage3-regenerated.jsonl: copied to work/drafts/regenerated.jsonl, the
# pipeline's regenerate stage finds every chunk done. The unlikelihood stage continues the model's own greedy
# outputs, so its run depends on the thread count's rounding: reruns land near the committed model, not on it (it
# was trained with THREADS=2).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=work/tiny_target
THREADS=${THREADS:-1}
python scripts/tiny_target/build_data.py
mkdir -p $W/model
python scripts/tiny_target/train.py --init-from examples/tiny-deepseek-v3 --out $W/model --lr 1e-3 --min-lr 5e-5 \
  --warmup 100 --max-steps 1600 --package-fraction 0.5 --ckpt-every 50 --eval-every 200 --threads "$THREADS"
cp examples/tiny-deepseek-v3/tokenizer.json examples/tiny-deepseek-v3/tokenizer_config.json $W/model/
python scripts/tiny_target/train.py --init-from $W/model --out $W/stage3/model --state $W/stage3 --max-steps 240 \
  --stop-at 120 --warmup 10 --lr 1e-4 --min-lr 1e-5 --package-fraction 0.5 --unlikelihood-weight 0.5 \
  --ul-round-steps 6 --eval-every 30 --ckpt-every 30 --snapshot-every 30 --threads "$THREADS"
cp examples/tiny-deepseek-v3/tokenizer.json examples/tiny-deepseek-v3/tokenizer_config.json $W/stage3/model/
[ -f $W/eval-start.json ] || python scripts/tiny_target/evaluate.py --threads "$THREADS" --out $W/eval-start.json
python scripts/tiny_target/evaluate.py --model $W/model --threads "$THREADS" --out $W/eval-stage2.json
python scripts/tiny_target/evaluate.py --model $W/stage3/model --threads "$THREADS" --out $W/eval-stage3.json
