"""Wall time of one `voronoi_owners` call at `small`-preset training sizes (4080 positions, V=4096, d=256),
for the auxiliary settings considered for the CPU presets.

    python scripts/time_voronoi.py
"""
import time

import torch

from hf_latentlm.modeling.auxiliaries import voronoi_owners, sample_auxiliary_bank
torch.manual_seed(0)
for P, N, M, d in [(4080, 128, 32, 256), (4080, 256, 64, 256), (4080, 512, 128, 256)]:
    logits = torch.randn(P, 4096) * 2
    W = torch.randn(4096, d) * 0.05
    bank = sample_auxiliary_bank(N, d, 0)
    voronoi_owners(logits[:256], W, bank, M)
    t = time.perf_counter(); a = voronoi_owners(logits, W, bank, M); dt = time.perf_counter() - t
    print(P, N, M, f"{dt*1000:.0f} ms", "TV", a.total_variation.mean().item(), flush=True)
