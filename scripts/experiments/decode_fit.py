"""Decoding's Voronoi fit on a trained PLM's own distributions, one position at a time as decoding fits them.

    python scripts/experiments/decode_fit.py runs/plm-small [--positions 256] [--sweeps 12 16 20]

For the encoder's next-token distributions at the first `--positions` positions of the validation stream, the ones
with three or more open candidates (those need a fit; the others take exact shortcuts): the wall time per position
of training's fit (`voronoi_owners` with the model's settings, the iterative shortlist fit) and of decoding's exact
cells (`exact_voronoi_owners`, dense sweeps then exact moves) at each `--sweeps`, the two timed alternately position by
position (a shared machine drifts between minutes); how many auxiliaries the dense sweeps leave to move; and that
the exact owners are training's wherever training's fit ends exact (its TV is 0), and hold the capacities exactly.
"""

import argparse
import json
import statistics
import time

import torch

from hf_latentlm.eval.harness import split_stream
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.modeling.auxiliaries import exact_voronoi_owners, fit_dense_offsets, ranked_candidates, voronoi_owners


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plm")
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--sweeps", nargs="+", type=int, default=[12, 16, 20])
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.plm)
    model.eval()
    cfg = model.config
    ids = split_stream(tokenizer, "validation")[:args.positions][None]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
        candidates, capacities = ranked_candidates(logits, cfg.auxiliary_top_m, cfg.num_auxiliaries)
        positions = ((capacities > 0).sum(dim=1) > 2).nonzero().squeeze(1).tolist()
        head, bank = model.lm_head.weight, model.model.auxiliary_bank
        scores = model.auxiliary_sampler.token_scores(head, bank)

        def training_fit(rows, ranked):
            return voronoi_owners(rows, head, bank, cfg.auxiliary_top_m, rounds=cfg.sinkhorn_rounds,
                                  sweeps=cfg.sinkhorn_sweeps, shortlist=cfg.sinkhorn_shortlist, scores=scores,
                                  ranked=ranked)

        training = training_fit(logits[positions], (candidates[positions], capacities[positions]))
        training_exact = (training.total_variation == 0).tolist()
        result = {"model": args.plm, "positions": args.positions, "fitted_positions": len(positions),
                  "training_fit_exact_positions": sum(training_exact), "threads": torch.get_num_threads(),
                  "by_sweeps": {}}
        for sweeps in args.sweeps:
            train_s, exact_s, moves, same, held = [], [], [], 0, 0
            for k, p in enumerate(positions):
                row, ranked = logits[p:p + 1], (candidates[p:p + 1], capacities[p:p + 1])
                start = time.perf_counter()
                training_fit(row, ranked)
                train_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                exact = exact_voronoi_owners(row, bank, cfg.auxiliary_top_m, scores, sweeps, ranked=ranked).owners[0]
                exact_s.append(time.perf_counter() - start)
                width = int((capacities[p] > 0).sum())
                cand, caps = candidates[p:p + 1, :width], capacities[p:p + 1, :width]
                chunk = scores.scores[cand]
                offsets = fit_dense_offsets(chunk, caps, scores.mean[cand], scores.std[cand], sweeps)
                local = (chunk + offsets[:, :, None]).argmax(dim=1)
                sizes = torch.zeros_like(caps).scatter_add_(1, local, torch.ones_like(local))
                moves.append(int((sizes - caps).clamp(min=0).sum()))
                held += bool(((exact[None, :] == cand[0, :, None]).sum(dim=1) == caps[0]).all())
                same += training_exact[k] and torch.equal(exact, training.owners[k])
            result["by_sweeps"][sweeps] = {
                "training_fit_ms": 1e3 * statistics.mean(train_s),
                "exact_cells_ms": 1e3 * statistics.mean(exact_s),
                "speedup": statistics.mean(train_s) / statistics.mean(exact_s),
                "mean_moves_after_dense_sweeps": statistics.mean(moves), "max_moves": max(moves),
                "positions_holding_capacities": held,
                "equal_where_training_fit_is_exact": same,
            }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
