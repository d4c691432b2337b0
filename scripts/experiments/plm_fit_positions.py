"""How many positions of a PLM training batch need the Voronoi fit: those whose observed token is an open top-M
candidate (`PLMForCausalLM.draw_auxiliaries` fits only these; elsewhere the decoder reads the mask auxiliary).

    python scripts/experiments/plm_fit_positions.py runs/plm-small runs/untrained/plm [--rows 16]

Encoder logits of the first `--rows` 256-token rows of the train split, eval mode.
"""

import argparse

import torch

from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.modeling.auxiliaries import ranked_candidates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="PLM folders")
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    for folder in args.models:
        model, tokenizer = load_model_and_tokenizer(folder)
        cfg = model.eval().config
        rows = nll_rows(split_stream(tokenizer, "train"), 256)[:args.rows]
        with torch.no_grad():
            q = model(input_ids=rows).logits[:, :-1].reshape(-1, cfg.vocab_size)
        candidates, capacities = ranked_candidates(q, cfg.auxiliary_top_m, cfg.num_auxiliaries)
        has_cell = ((candidates == rows[:, 1:].reshape(-1, 1)) & (capacities > 0)).any(1)
        print(f"{folder}: {int(has_cell.sum())} of {has_cell.numel()} positions need the fit "
              f"({has_cell.float().mean():.1%})")


if __name__ == "__main__":
    main()
