"""Run by test_loop.py (under torchrun or alone): train a `tiny` model of FAMILY on fixed rows and write this
rank's final parameters to OUT/rank<r>.safetensors.

    ddp_worker.py OUT ROWS BATCH_SIZE [--family F] [--max-steps N] [--stop-at-step N] [--save-every N] [--resume]
                  [--component NAME=DIR ...] [--rank-draws] [--dtype float32|float64]
                  [--init-from AR_DIR] [--encoder-kl-weight W]
"""

import argparse
import os

import torch
from safetensors.torch import save_file

from hf_latentlm.cli import end_process_group
from hf_latentlm.families import build_model
from hf_latentlm.training.corpus import load_default_tokenizer
from hf_latentlm.training.loop import TrainConfig, load_source_model, train

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("rows_file")
parser.add_argument("batch_size", type=int)
parser.add_argument("--family", default="ar")
parser.add_argument("--max-steps", type=int, default=4)
parser.add_argument("--stop-at-step", type=int)
parser.add_argument("--save-every", type=int, help="default: --max-steps")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--component", action="append", default=[], help="NAME=DIR")
parser.add_argument("--rank-draws", action="store_true", help="rank r draws r + 1 numbers after step 1")
parser.add_argument("--init-from", help="a saved `ar` folder to build the model from, as `train --init-from` does")
parser.add_argument("--encoder-kl-weight", type=float, default=0.0)
parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="float64: runs that sum gradients in another order agree to rounding far below any bug")
args = parser.parse_args()

rows = torch.load(args.rows_file, weights_only=True)
tokenizer = load_default_tokenizer()
components = dict(c.split("=", 1) for c in args.component)
torch.manual_seed(0)
source = load_source_model(args.init_from) if args.init_from else None
model = build_model(args.family, "tiny", tokenizer, init_from=source, **components)
model = model.to(getattr(torch, args.dtype))
cfg = TrainConfig(family=args.family, preset="tiny", output_dir=args.out, max_steps=args.max_steps,
                  stop_at_step=args.stop_at_step, resume=args.resume, batch_size=args.batch_size, seq_len=64,
                  eval_every=0, save_every=args.save_every or args.max_steps, log_every=1, progress_bar=False, seed=0,
                  components=components, init_from=args.init_from, encoder_kl_weight=args.encoder_kl_weight)
rank = int(os.environ.get("RANK", "0"))


def rank_draws(step, metrics):
    # Puts the ranks' RNG streams apart, so a rank resumed from another rank's RNG state would show.
    if args.rank_draws and step == 1:
        torch.rand(rank + 1)


train(cfg, model=model, tokenizer=tokenizer, train_rows=rows, on_step=rank_draws)
# (A DTensor under FSDP, run by fsdp_worker.py: gathered, on every rank.)
save_file({k: (v.full_tensor() if hasattr(v, "full_tensor") else v).contiguous() for k, v in model.state_dict().items()},
          f"{args.out}/rank{rank}.safetensors")
end_process_group()  # as the CLI does: a rank left to tear gloo down at exit can abort
