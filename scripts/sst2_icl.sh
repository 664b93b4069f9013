#!/usr/bin/env bash
# Issue 13 evidence: in-context SST-2 (k = 0, 1, 4, 8) for a GPT-2 decoder trained here on SST-2's sentences,
# next to a majority-class baseline, through eval.py --fewshot and through lm-eval with both the lmzoo model and
# lm-eval's HF backend on the exported weights (pip install -r requirements-test.txt). Writes $OUT (default
# runs/sst2_icl/). STEPS / EXAMPLES (eval.py) / LM_EVAL_EXAMPLES (each lm-eval run; default EXAMPLES) / KS shrink it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/sst2_icl}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the lm-eval task file names its data files
SST2=${SST2:-../shared/data/sst2}
GPT2_BPE=${GPT2_BPE:-$(dirname "$SST2")/tokenizers/gpt2}
STEPS=${STEPS:-1000}
KS=${KS:-0,1,4,8}
EXAMPLES=${EXAMPLES:-872}
LM_EVAL_EXAMPLES=${LM_EVAL_EXAMPLES:-$EXAMPLES}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

python scripts/sst2_icl_data.py --out=$OUT/data --sst2=$SST2
python train.py --config=configs/sst2_lm.py --workdir=$OUT/lm --config.data.path=$OUT/data/corpus.txt \
  --config.data.tokenizer="{'kind': 'gpt2', 'path': '$GPT2_BPE'}" --config.data.seq_len=64 --config.train.batch_size=8 \
  --config.train.steps=$STEPS --config.optim.decay_steps=$STEPS --config.train.eval_every=200 \
  --config.train.checkpoint_every=200 --config.eval.max_batches=10
python eval.py --workdir=$OUT/lm --plot
python eval.py --workdir=$OUT/lm --fewshot=$OUT/data/dev.jsonl --fewshot_train=$OUT/data/train.jsonl --fewshot_k=$KS \
  --fewshot_template="{context} it was" --fewshot_examples=$EXAMPLES --dump_prompts=$OUT/prompts.jsonl
python -m lmzoo.cli.export --workdir=$OUT/lm --out=$OUT/hf

mkdir -p $OUT/tasks
cat > $OUT/tasks/sst2_icl.yaml <<YAML
task: sst2_icl
dataset_path: json
dataset_kwargs:
  data_files:
    train: $OUT/data/train.jsonl
    validation: $OUT/data/dev.jsonl
output_type: multiple_choice
training_split: train
validation_split: validation
fewshot_split: train
doc_to_text: "{{context}} it was"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
YAML
for k in ${KS//,/ }; do
  python -m lmzoo.cli.harness run --model lmzoo --model_args workdir=$OUT/lm --tasks sst2_icl \
    --include_path $OUT/tasks --num_fewshot $k --limit $LM_EVAL_EXAMPLES --batch_size 16 --log_samples --output_path $OUT/lm_eval/lmzoo_k$k
  python -m lmzoo.cli.harness run --model hf --model_args pretrained=$OUT/hf,dtype=float32 --device cpu \
    --tasks sst2_icl --include_path $OUT/tasks --num_fewshot $k --limit $LM_EVAL_EXAMPLES --batch_size 16 \
    --log_samples --output_path $OUT/lm_eval/hf_k$k
done
python scripts/sst2_icl_compare.py --workdir=$OUT/lm --hf=$OUT/hf --lm_eval=$OUT/lm_eval
