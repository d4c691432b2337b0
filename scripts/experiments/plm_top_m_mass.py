"""The top-M mass Z_M of a PLM's encoder distribution at the reference answer positions of a task's test prompts: how
far the encoder's q (GRPO's log-probabilities) is from the top-M renormalised q its rollouts draw from
(hf_latentlm/training/grpo.py).

    python scripts/experiments/plm_top_m_mass.py runs/grpo/plm/sft [count-tens] [32]
"""
import sys

import torch
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.tasks import load_task
m, t = load_model_and_tokenizer(sys.argv[1]); m.eval()
test = load_task((sys.argv[2] if len(sys.argv) > 2 else "count-tens"), split_sizes={"train": 1, "test": int(sys.argv[3]) if len(sys.argv) > 3 else 32})["test"]
masses = []
with torch.no_grad():
    for p, c in zip(test["prompt"], test["completion"]):
        ids = t(p + c, return_tensors="pt")["input_ids"]
        n = len(t(p)["input_ids"])
        q = m(input_ids=ids).logits[0, n - 1:-1].float().softmax(-1)
        masses.append(q.topk(m.config.auxiliary_top_m, dim=-1).values.sum(-1))
z = torch.cat(masses)
print(f"top-{m.config.auxiliary_top_m} mass over {z.numel()} answer positions: min {z.min():.6f} mean {z.mean():.6f} 1-mean {1-z.mean():.2e}")
