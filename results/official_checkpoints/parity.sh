#!/usr/bin/env bash
# Convert each committed official-format fixture and run the parity check on it; prints NAME max_abs_diff=X lines.
#   bash results/official_checkpoints/parity.sh > results/official_checkpoints/parity.txt
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
for name in calm calm_tools calm_heldout; do
  src=tests/fixtures/official/$name
  args=(--model "$src/calm")
  [ -d "$src/autoencoder" ] && args+=(--autoencoder "$src/autoencoder")
  .venv/bin/hf-latentlm convert calm "${args[@]}" --output-dir "$out/$name" > /dev/null
  echo "## $name"
  .venv/bin/python scripts/checks/official_parity.py --family calm --model "$out/$name" \
    --reference "$src/reference_outputs.safetensors"
done
for name in cola cola_tools cola_heldout; do
  src=tests/fixtures/official/$name
  .venv/bin/hf-latentlm convert cola --vae "$src/cola_vae" --dit "$src/cola_dit" --output-dir "$out/$name" > /dev/null
  echo "## $name"
  OMP_NUM_THREADS=1 .venv/bin/python scripts/checks/official_parity.py --family cola --model "$out/$name" \
    --reference "$src/reference_outputs.safetensors" --mark-verified
done
rm -rf "$out"
