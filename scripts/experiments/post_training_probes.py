"""Small measurements behind results/post_training_count_tens/, one sub-command each.

    python scripts/experiments/post_training_probes.py dpo runs/tens/ar/sft OUT 5e-5 sigmoid ['{"policy_rejections": true}']
        # run_dpo with the bench's DPO settings (120 steps, 960 pairs, batch 8), then exact match on the 298 test
        # prompts
    python scripts/experiments/post_training_probes.py sampled-rejections runs/tens/ar/sft runs/tens/plm/sft runs/tens/calm/sft
        # how many of the 960 DPO pairs get the model's own (wrong) answer as rejected, as run_dpo samples them
    python scripts/experiments/post_training_probes.py calm-autoencoder runs/tens/calm/sft
        # token accuracy of CALM's frozen autoencoder on count-tens answers and on as many validation-corpus tokens
"""
import collections
import json
import sys

import torch

from hf_latentlm.eval.task import evaluate_task
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.recipes import SAMPLED_REJECTION, run_dpo, with_policy_rejections
from hf_latentlm.training.corpus import load_corpus_documents
from hf_latentlm.training.tasks import load_preference_task, load_task

TASK = "count-tens"


def dpo(model_dir, out, lr, loss, extra="{}"):
    run_dpo(model_dir, out, task=TASK, max_steps=120, seed=0, train_size=960, learning_rate=float(lr), batch_size=8,
            loss_type=[loss], logging_steps=5, **json.loads(extra))
    test = load_task(TASK, split_sizes={"train": 1, "test": 298})["test"]
    model, tokenizer = load_model_and_tokenizer(out)
    result = evaluate_task(model, tokenizer, test, speed_prompts=1)
    print(json.dumps({"model": out, "lr": float(lr), "loss_type": loss, **json.loads(extra),
                      "accuracy": result["accuracy"], "mean_answer_tokens": result["mean_answer_tokens"]}))


def sampled_rejections(*folders):
    for folder in folders:
        model, tokenizer = load_model_and_tokenizer(folder)
        pairs = load_preference_task(TASK, tokenizer=tokenizer, seed=0, split_sizes={"train": 960})["train"]
        kinds = collections.Counter(with_policy_rejections(pairs, model, tokenizer, batch_size=8, seed=0)["rejected_kind"])
        print(json.dumps({"model": folder, "pairs": len(pairs), "sampled": kinds[SAMPLED_REJECTION], "kinds": kinds}))


def calm_autoencoder(folder):
    model, tokenizer = load_model_and_tokenizer(folder)
    autoencoder, rows = model.autoencoder.eval(), 64 * model.config.chunk_size
    test = load_task(TASK, split_sizes={"train": 1, "test": 298})["test"]

    def rows_of(texts):
        flat = [i for text in texts for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        return torch.tensor(flat[: len(flat) // rows * rows]).view(-1, rows)

    with torch.no_grad():
        counts = rows_of(list(test["completion"]))
        answers = autoencoder.reconstruction_accuracy(counts, torch.Generator().manual_seed(0))
        corpus = rows_of(load_corpus_documents("validation"))[: counts.shape[0]]
        prose = autoencoder.reconstruction_accuracy(corpus, torch.Generator().manual_seed(0))
    print(json.dumps({"count_tens_answers": answers, "validation_corpus": prose}, indent=1))


COMMANDS = {"dpo": dpo, "sampled-rejections": sampled_rejections, "calm-autoencoder": calm_autoencoder}

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](*sys.argv[2:])
