#!/usr/bin/env bash
# The bundled tiny DeepSeek-V3, its second stage: continued pretraining of examples/tiny-deepseek-v3 (1,200 steps on
# the standard library) on the standard library and the Python sources of the packages eyas installs, half and
# half (plus the derived chat conversations, 20% of rows), 1,600 steps of 8 x 512 tokens on a fresh cosine schedule;
# then its evaluation against the model it started from.
#
#   bash scripts/tiny_target/make.sh        # rerun after an interruption: every stage resumes or is skipped
#
# The trained model lands in $OUT (work/tiny_target/model); reports in work/tiny_target/eval-*.json. Its result is
# committed as scripts/tiny_target/stage2-model (report: examples/reports/tiny-target-stage2.json): the point a
# further stage starts from on a machine without work/ (train.py --init-from scripts/tiny_target/stage2-model).
# It replaces examples/tiny-deepseek-v3 only together with drafts trained on it.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=work/tiny_target
OUT=${OUT:-$W/model}
THREADS=${THREADS:-1}
python scripts/tiny_target/build_data.py
mkdir -p "$OUT"
python scripts/tiny_target/train.py --init-from examples/tiny-deepseek-v3 --out "$OUT" --lr 1e-3 --min-lr 5e-5 \
  --warmup 100 --max-steps 1600 --package-fraction 0.5 --ckpt-every 50 --eval-every 200 --threads "$THREADS"
cp examples/tiny-deepseek-v3/tokenizer.json examples/tiny-deepseek-v3/tokenizer_config.json "$OUT"/
[ -f $W/eval-start.json ] || python scripts/tiny_target/evaluate.py --threads "$THREADS" --out $W/eval-start.json
python scripts/tiny_target/evaluate.py --model "$OUT" --threads "$THREADS" --out $W/eval-trained.json
