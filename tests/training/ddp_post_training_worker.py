"""Run by test_post_training.py under `torchrun --nproc_per_node 2` (or alone): post-train the model in MODEL_DIR,
`run_sft` (full fine-tuning) into OUT/sft, then `run_dpo` with LoRA from that checkpoint into OUT/dpo, on the rows of
DATA_JSON ({"sft": [{prompt, completion}], "dpo": [{prompt, chosen, rejected}]}). Per stage and rank it writes the
trained parameters at the end of training (before any LoRA merge) to OUT/<stage>-rank<r>.safetensors and this rank's
view to OUT/<stage>-rank<r>.json: world size, the losses, and for DPO the precomputed pair keys, reference scores,
phases and auxiliaries of the train set.

    ddp_post_training_worker.py MODEL_DIR OUT DATA_JSON [--max-steps N]
"""

import argparse
import json
import os

from datasets import Dataset
from safetensors.torch import save_file
from transformers import TrainerCallback

from hf_latentlm.cli import end_process_group
from hf_latentlm.recipes import run_dpo, run_sft
from hf_latentlm.training.post_training import PAIR_KEY, REF_CHOSEN, REF_REJECTED

parser = argparse.ArgumentParser()
parser.add_argument("model_dir")
parser.add_argument("out")
parser.add_argument("data")
parser.add_argument("--max-steps", type=int, default=3)
args = parser.parse_args()
rank = int(os.environ.get("RANK", "0"))
os.makedirs(args.out, exist_ok=True)
with open(args.data) as f:
    data = json.load(f)


class RecordRank(TrainerCallback):
    """This rank's trainable parameters at the end of training and its copy of the precomputed columns."""

    def __init__(self, stage):
        self.stage = stage
        self.view = {"world_size": int(os.environ.get("WORLD_SIZE", "1"))}

    def on_train_begin(self, train_args, state, control, train_dataloader=None, **kwargs):
        dataset = train_dataloader.dataset if train_dataloader is not None else None
        if dataset is not None and REF_CHOSEN in dataset.column_names:
            for name in (PAIR_KEY, REF_CHOSEN, REF_REJECTED, "chosen_draw_phase", "rejected_draw_phase",
                         "chosen_draw_aux", "rejected_draw_aux"):
                self.view[name] = list(dataset[name])

    def on_train_end(self, train_args, state, control, model=None, **kwargs):
        tensors = {n: p.detach().contiguous().clone() for n, p in model.named_parameters() if p.requires_grad}
        save_file(tensors, os.path.join(args.out, f"{self.stage}-rank{rank}.safetensors"))
        self.view["losses"] = [e["loss"] for e in state.log_history if "loss" in e]


def stage(name, run, model_dir, **kwargs):
    record = RecordRank(name)
    summary = run(model_dir, os.path.join(args.out, name), max_steps=args.max_steps, batch_size=2, logging_steps=1,
                  warmup_steps=0, dataset=Dataset.from_list(data[name]), callbacks=[record], **kwargs)
    record.view["summary"] = summary
    with open(os.path.join(args.out, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(record.view, f)


stage("sft", run_sft, args.model_dir, learning_rate=1e-3)
stage("dpo", run_dpo, os.path.join(args.out, "sft"), lora=True, learning_rate=1e-2)
end_process_group()
