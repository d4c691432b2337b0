"""Run by test_grpo.py under `torchrun --nproc_per_node 2`: LoRA GRPO (β > 0, so the reference is the
adapter-disabled model) of the model in MODEL_DIR into OUT/grpo, with a reward that an untrained model meets half
the time (the fraction of completion tokens with ids below 2048). Per rank it writes the trainable (LoRA)
parameters at the end of training to OUT/grpo-rank<r>.safetensors, and to OUT/grpo-rank<r>.json the world size, the
losses, the logged KL values and the completions this rank generated.

    ddp_grpo_worker.py MODEL_DIR OUT
"""

import argparse
import json
import os

from safetensors.torch import save_file
from transformers import TrainerCallback

from hf_latentlm.cli import end_process_group
from hf_latentlm.recipes import run_grpo

parser = argparse.ArgumentParser()
parser.add_argument("model_dir")
parser.add_argument("out")
args = parser.parse_args()
rank = int(os.environ.get("RANK", "0"))
os.makedirs(args.out, exist_ok=True)
completions = []


def low_token_reward(completions_text, completion_ids, **kwargs):
    completions.extend(completion_ids)
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def reward(completions, completion_ids, **kwargs):  # TRL's keyword names
    return low_token_reward(completions, completion_ids)


class RecordRank(TrainerCallback):
    def on_train_end(self, train_args, state, control, model=None, **kwargs):
        tensors = {n: p.detach().contiguous().clone() for n, p in model.named_parameters() if p.requires_grad}
        save_file(tensors, os.path.join(args.out, f"grpo-rank{rank}.safetensors"))
        view = {"world_size": int(os.environ.get("WORLD_SIZE", "1")), "completions": completions,
                "losses": [e["loss"] for e in state.log_history if "loss" in e],
                "kl": [e["kl"] for e in state.log_history if "kl" in e]}
        with open(os.path.join(args.out, f"grpo-rank{rank}.json"), "w") as f:
            json.dump(view, f)


try:
    run_grpo(args.model_dir, os.path.join(args.out, "grpo"), task="count-tens", train_size=8, max_steps=3,
             lora=True, batch_size=4, num_generations=4, learning_rate=1e-2, beta=0.04, num_score_draws=1,
             logging_steps=1, reward_funcs=[reward], callbacks=[RecordRank()])
finally:
    end_process_group()
