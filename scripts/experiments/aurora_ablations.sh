#!/usr/bin/env bash
# AURORA-LM ablations (issue 12): short runs of the `small` preset on one frozen autoencoder, identical except for
# the one field each changes. Budget per run: 120 steps x 16 rows x 128 tokens = 0.25M tokens (a tenth of the main
# model's), with the consistency ramp shortened to 40 steps so that it is fully on for most of the run.
# Usage: bash scripts/experiments/aurora_ablations.sh AUTOENCODER_DIR OUT_PREFIX
set -euo pipefail
ae=${1:-runs/aurora-ae-small}
out=${2:-runs/aurora-abl}
common=(--family aurora --preset small --autoencoder "$ae" --seq-len 128 --batch-size 16 --max-steps 120
        --eval-every 60 --save-every 60 --no-sample --config consistency_warmup_steps=40)
hf-latentlm train "${common[@]}" --output-dir "$out-base"
hf-latentlm train "${common[@]}" --output-dir "$out-no-stc" --config consistency_weight=0
hf-latentlm train "${common[@]}" --output-dir "$out-velocity" --config loss_space=velocity
hf-latentlm train "${common[@]}" --output-dir "$out-full-rank" --config noisy_input_rank=null
hf-latentlm train "${common[@]}" --output-dir "$out-rank16" --config noisy_input_rank=16
