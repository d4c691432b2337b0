"""Wall time and fit quality of `voronoi_owners` at the `small` preset's sizes (V=4096, d=256).

Training sizes: P = 4080 positions (16 rows x 255) with (N auxiliaries, M candidates) = (512, 128), (256, 64),
(128, 32). Decode sizes: P = 4 (batch 1) and P = 32 (batch 8) with the token scores precomputed (`token_scores`, as
the model caches them per LM-head weight version). Inputs are realistic synthetic ones: LM-head-like rows (random
directions, norms 1-3) and next-token logits with a Zipfian rank profile plus a part aligned with the head geometry,
tempered per position to an entropy drawn in one of three regimes: peaked (0.5-1.5 nats), mid (2-4) and flat
(4.5-6); trained LMs at this scale average ~3-5 nats. Reported: median wall time over `--repeats` calls, mean TV
between fitted cell sizes and capacities per regime and overall (paper App. 12: < 0.3%).

    python scripts/experiments/time_voronoi.py                       # default fit settings, 2 threads
    python scripts/experiments/time_voronoi.py --settings 2,12,8 4,5,6 --threads 1
"""
import argparse
import time

import torch

from hf_latentlm.modeling.auxiliaries import (
    DEFAULT_ROUNDS,
    DEFAULT_SHORTLIST,
    DEFAULT_SWEEPS,
    sample_auxiliary_bank,
    token_scores,
    voronoi_owners,
)

VOCAB, DIM = 4096, 256
REGIMES = {"peaked": (0.5, 1.5), "mid": (2.0, 4.0), "flat": (4.5, 6.0)}


def lm_head(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(VOCAB, DIM, generator=g)
    return rows / rows.norm(dim=-1, keepdim=True) * (1 + 2 * torch.rand(VOCAB, 1, generator=g))


def regime_logits(positions: int, head: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[int]]:
    """[positions, V] logits in three equal groups (peaked, mid, flat) and the group sizes."""
    g = torch.Generator().manual_seed(seed)
    sizes = [positions // 3, positions // 3, positions - 2 * (positions // 3)]
    entropy = torch.cat([lo + (hi - lo) * torch.rand(n, generator=g) for (lo, hi), n in zip(REGIMES.values(), sizes)])
    h = torch.randn(positions, DIM, generator=g)
    geometric = (h / h.norm(dim=-1, keepdim=True) * 8.0) @ head.T
    ranks = torch.argsort(torch.rand(positions, VOCAB, generator=g), dim=-1).float() + 1
    base = -1.1 * ranks.log() + 0.5 * geometric
    lo, hi = torch.full((positions, 1), 1e-3), torch.full((positions, 1), 1e3)
    for _ in range(60):  # bisection on the inverse temperature, per position
        mid = (lo * hi).sqrt()
        logp = torch.log_softmax(base * mid, dim=-1)
        too_flat = -(logp.exp() * logp).sum(-1, keepdim=True) > entropy[:, None]
        lo, hi = torch.where(too_flat, mid, lo), torch.where(too_flat, hi, mid)
    return base * (lo * hi).sqrt(), sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = f"{DEFAULT_ROUNDS},{DEFAULT_SWEEPS},{DEFAULT_SHORTLIST}"
    parser.add_argument("--settings", nargs="+", default=[default], help="rounds,sweeps,shortlist (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="training sizes; decode sizes use 10x as many")
    parser.add_argument("--positions", type=int, default=4080)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    head = lm_head(0)
    logits, sizes = regime_logits(args.positions, head, 1)
    print(f"threads={args.threads}; TV in % per regime (peaked / mid / flat) and mean; time = median wall time")
    cases = [(args.positions, 512, 128), (args.positions, 256, 64), (args.positions, 128, 32), (4, 512, 128), (32, 512, 128)]
    for setting in args.settings:
        rounds, sweeps, shortlist = (int(x) for x in setting.split(","))
        for positions, num_aux, top_m in cases:
            bank = sample_auxiliary_bank(num_aux, DIM, seed=0)
            scores = token_scores(head, bank)
            decode = positions < args.positions
            if decode:  # positions from all three regimes, the first ones of each
                rows = torch.cat([torch.arange(s, s + (positions + 2) // 3) for s in (0, sizes[0], sizes[0] + sizes[1])])
                x, groups = logits[rows[:positions]], None
            else:
                x, groups = logits, sizes
            call = lambda: voronoi_owners(x, head, bank, top_m, rounds=rounds, sweeps=sweeps, shortlist=shortlist,
                                          scores=scores if decode else None)
            fit = call()  # warm-up
            times = []
            for _ in range(args.repeats * (10 if decode else 1)):
                start = time.perf_counter()
                fit = call()
                times.append(time.perf_counter() - start)
            ms = sorted(times)[len(times) // 2] * 1000
            tv = fit.total_variation * 100
            per_regime = " / ".join(f"{t.mean():.3f}" for t in tv.split(groups)) if groups else "-"
            label = "decode, cached scores" if decode else "training, scores computed in the call"
            print(f"{rounds}x{sweeps}x{shortlist}  P={positions:5d} N={num_aux:3d} M={top_m:3d}  {ms:9.2f} ms  "
                  f"TV% {per_regime}  mean {tv.mean():.3f}  ({label})", flush=True)


if __name__ == "__main__":
    main()
