"""Batch-1 generate() time and Python call count of tiny Cola, AURORA, CALM and PLM models (the seeded builders of
tests/modeling/previous_layout.py) under whichever hf_latentlm is importable, so that two layouts of the package are
compared on one machine (results/refactor_decoding_cost/):

    git worktree add /tmp/old 9549185
    PYTHONPATH=/tmp/old python scripts/experiments/compare_layouts.py old
    python scripts/experiments/compare_layouts.py new
"""

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "modeling"))
import previous_layout  # noqa: E402

SEED_OPTION = {"cola": "noise_seeds", "aurora": "noise_seeds", "calm": "noise_seeds", "plm": "auxiliary_seeds"}

torch.set_num_threads(1)
for family in previous_layout.FAMILIES:
    model = previous_layout.build(family).eval()
    prompt = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=32, min_new_tokens=32, eos_token_id=None,
                  **{SEED_OPTION[family]: [1]})
    model.generate(prompt, **kwargs)  # warm-up
    times = []
    for _ in range(7):
        start = time.perf_counter()
        model.generate(prompt, **kwargs)
        times.append(time.perf_counter() - start)
    profiler = cProfile.Profile()
    profiler.runcall(model.generate, prompt, **kwargs)
    calls = pstats.Stats(profiler).total_calls
    print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} {family}: median {statistics.median(times) * 1000:.1f} ms, "
          f"{calls} Python calls per generate()")
