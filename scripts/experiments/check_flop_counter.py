"""FlopCounter (the project's torch-function counter, hf_latentlm/eval/flops.py) against torch's FlopCounterMode on a
`tiny` model of every family: one training step (FlopCounterMode: eager attention, the real backward; FlopCounter:
SDPA, backward from the forward alone) and one whole `generate()` (16-token prompts, 8 new tokens, batch 2).

    python scripts/experiments/check_flop_counter.py

Prints, per family and measure, both counts and their ratio (tests/eval/test_flops.py holds it within 5%).
"""

import torch

from hf_latentlm.eval.flops import compare_with_flop_counter_mode
from hf_latentlm.families import build_fresh_model
from hf_latentlm.training.corpus import load_default_tokenizer


def main():
    tokenizer = load_default_tokenizer()
    for family in ("ar", "plm", "calm", "cola", "aurora"):
        model = build_fresh_model(family, "tiny", tokenizer)
        rows = torch.randint(3, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(0))
        counts = compare_with_flop_counter_mode(model, rows)
        for measure in ("training", "generate"):
            reference, ours = counts[measure]
            print(f"{family:7s} {measure:9s} FlopCounterMode {reference:.4g}  FlopCounter {ours:.4g}  "
                  f"ratio {ours / reference:.4f}")

if __name__ == "__main__":
    main()
