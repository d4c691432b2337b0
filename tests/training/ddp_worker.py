"""Run by test_loop.py (under torchrun or alone): train `tiny` for 4 steps on fixed rows and
write this rank's final parameters to OUT/rank<r>.safetensors."""

import sys

import torch
from safetensors.torch import save_file

from hf_latentlm.families import build_model
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.loop import TrainConfig, train

out, rows_file, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = torch.load(rows_file, weights_only=True)
tokenizer = load_default_tokenizer()
torch.manual_seed(0)
model = build_model("ar", "tiny", tokenizer)
cfg = TrainConfig(family="ar", preset="tiny", output_dir=out, max_steps=4, batch_size=batch_size, seq_len=64,
                  eval_every=0, save_every=4, log_every=1, progress_bar=False, seed=0)
train(cfg, model=model, tokenizer=tokenizer, train_rows=rows)
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{out}/rank{rank}.safetensors")
