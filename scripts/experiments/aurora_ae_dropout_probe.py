"""Probe: how fast the `small` AURORA autoencoder learns to reconstruct, with the paper's dropouts or lighter ones.

    OMP_NUM_THREADS=1 python scripts/experiments/aurora_ae_dropout_probe.py default   # token 0.3 / latent 0.6 (paper)
    OMP_NUM_THREADS=1 python scripts/experiments/aurora_ae_dropout_probe.py low       # token 0.1 / latent 0.2

300 AdamW steps (lr 2e-3, no schedule) of 64 rows × 64 train tokens; every 50 steps it prints the training loss and
accuracy and the eval-mode reconstruction accuracy of 16 validation rows cut at 256 and at 64 tokens.
"""

import sys
import time

import torch

from hf_latentlm.eval.harness import split_stream
from hf_latentlm.families import build_model
from hf_latentlm.training.corpus import load_default_tokenizer

tokenizer = load_default_tokenizer()
stream = split_stream(tokenizer, "train")
length, batch, steps = 64, 64, 300
rows = stream[: (stream.numel() // length) * length].view(-1, length)
validation = split_stream(tokenizer, "validation")[: 256 * 16].view(16, 256)
torch.manual_seed(0)
overrides = {"token_dropout": 0.1, "latent_dropout": 0.2} if sys.argv[1] == "low" else {
    "token_dropout": 0.3, "latent_dropout": 0.6}
model = build_model("aurora-ae", "small", tokenizer, **overrides)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95))
model.train()
start = time.time()
for step in range(steps):
    ids = rows[torch.randint(0, len(rows), (batch,))]
    out = model(ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 50 == 49:
        model.eval()
        at_256, at_64 = model.reconstruction_accuracy(validation), model.reconstruction_accuracy(validation.view(-1, 64))
        model.train()
        print(sys.argv[1], step + 1, round(out.loss.item(), 3), round(out.token_accuracy.item(), 3), "val256",
              round(at_256, 3), "val64", round(at_64, 3), f"{time.time() - start:.0f}s", flush=True)
