"""Write official-format Cola DLM checkpoints (text VAE + DiT) and the official code's outputs on fixed inputs (data
for scripts/checks/official_parity.py and tests/official/).

Runs in its OWN environment, with what the official code needs (transformers 4.x, torch, einops,
rotary-embedding-torch), and imports the official package from a clone you name; nothing of it is copied here.
Example:

    python -m venv /tmp/cola-env && /tmp/cola-env/bin/pip install torch==2.13.0 transformers==4.43.0 einops \
        rotary-embedding-torch safetensors
    /tmp/cola-env/bin/python scripts/checks/official_reference_cola.py --official-clone /path/to/Cola-DLM \
        --output-dir tests/fixtures/official/cola_heldout --dim 36 --num-heads 6 --shared-heads-kv 6 ...

It builds a tiny VAE and DiT of the given sizes with the official classes, perturbs every parameter by Gaussian
noise (so zero-initialised layers are not zero), saves each with `save_pretrained` (`config.json` +
`model.safetensors`, as the released checkpoint is laid out) and records, in `reference_outputs.safetensors` (the
keys of ../shared/reference/cola; rows concatenated along one axis, as the official code lays them out): the VAE's
posterior mean and log-variance of each row, its decoder logits for given latents, the DiT's velocity over all rows
with clean history (t = 0) and each row's last block at `--time`, and the unconditional velocity of those last blocks
alone. Official config fields without an option here keep the official defaults (the released values).

`--checkpoint DIR` loads the official VAE and DiT already in DIR (`cola_vae/`, `cola_dit/`) instead of building
them, and adds to DIR's reference file the official inference's tokens (`generate_task_repaint_inference`, greedy,
CFG `--guidance-scale`, `--timestep-num` steps, repetition penalty, one batch of prompts of `--generate-lengths`
tokens, its per-sample noise seeding `COLA_INFER_PER_SAMPLE_NOISE_SEED`): `generate_prompt{i}` the prompt ids,
`generate_tokens{i}` the official output (the prompt's re-decoded tail trimmed), `generate_prompt_latents{i}` the
latents it encoded the prompt to (filled with pad tokens to whole blocks), `generate_row_seeds` each row's
seed (base + 1000·row) and the settings as 0-dim tensors. The official inference casts its inputs to bfloat16 for
CUDA autocast, which a CPU cannot run; the script runs it in float32 by handing that module a `torch` whose
`bfloat16` is float32 (the models' own attention autocast is untouched).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official-clone", required=True, help="a clone of ByteDance-Seed/Cola-DLM")
    parser.add_argument("--output-dir", help="where to write (not needed with --count-released-sizes)")
    parser.add_argument("--count-released-sizes", action="store_true",
                        help="only print the parameter counts of the official default configs (the released "
                             "sizes), built on the meta device")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=71)
    parser.add_argument("--dim", type=int, default=40)
    parser.add_argument("--ffn-dim", type=int, default=88)
    parser.add_argument("--latent-dim", type=int, default=6)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--shared-heads-kv", type=int, default=1)
    parser.add_argument("--encoder-blocks", type=int, default=2)
    parser.add_argument("--decoder-blocks", type=int, default=3)
    parser.add_argument("--vae-block-size", type=int, default=4)
    parser.add_argument("--rope-theta", type=float, default=500000)
    parser.add_argument("--layer-norm-eps", type=float, default=1e-6)
    parser.add_argument("--scaling-factor", type=float, default=1.7)
    parser.add_argument("--shifting-factor", type=float, default=0.2)
    parser.add_argument("--txt-dim", type=int, default=48)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=12)
    parser.add_argument("--expand-ratio", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--rope-dim", type=int, default=8)
    parser.add_argument("--norm-eps", type=float, default=1e-5)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--row-lengths", type=int, nargs="+", default=[12, 8],
                        help="tokens per row, each a multiple of --block-size")
    parser.add_argument("--time", type=float, default=700.0, help="official time (0..1000) of each row's last block")
    parser.add_argument("--perturb-std", type=float, default=0.04)
    parser.add_argument("--checkpoint", help="record only the official generation of the checkpoint in this folder")
    parser.add_argument("--generate-lengths", type=int, nargs="+", default=[6, 3, 8, 13],
                        help="prompt lengths of the generation batch")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--guidance-scale", type=float, default=7.0)
    parser.add_argument("--timestep-num", type=int, default=16)
    parser.add_argument("--repetition-penalty", type=float, default=1.1)
    parser.add_argument("--noise-seed", type=int, default=1234, help="COLA_INFER_PER_SAMPLE_NOISE_SEED")
    return parser.parse_args()


class _Float32Torch:
    """`torch` as the official inference module sees it, with bfloat16 read as float32."""

    bfloat16 = torch.float32

    def __getattr__(self, name):
        return getattr(torch, name)


class _IdTokenizer:
    """The official inference tokenises a prompt string: here each string names a prepared list of ids."""

    def __init__(self, prompts: dict[str, list[int]]):
        self.prompts, self.outputs = prompts, None

    def encode(self, text):
        return type("Encoding", (), {"ids": list(self.prompts[text])})()

    def decode_batch(self, ids, skip_special_tokens=False):
        self.outputs = [list(row) for row in ids]
        return ["" for _ in ids]


def record_generation(args) -> int:
    import os

    from cola_dlm import inference
    from cola_dlm.modeling_cola_dit import ColaDiTModel
    from cola_dlm.modeling_cola_vae import ColaTextVAEModel
    from safetensors.torch import load_file

    folder = Path(args.checkpoint)
    vae = ColaTextVAEModel.from_pretrained(folder / "cola_vae").float().eval()
    dit = ColaDiTModel.from_pretrained(folder / "cola_dit").float().eval()
    torch.manual_seed(args.seed)
    vocab, pad = vae.config.vocab_size, vae.config.pad_token_id
    prompts = {f"p{i}": torch.randint(0, vocab - 1, (n,)).tolist() for i, n in enumerate(args.generate_lengths)}
    tokenizer = _IdTokenizer(prompts)
    encoded = []
    official_encode = vae.encode
    vae.encode = lambda rows: encoded.append(official_encode(rows)) or encoded[-1]
    inference.torch = _Float32Torch()
    os.environ["COLA_INFER_PER_SAMPLE_NOISE_SEED"] = str(args.noise_seed)
    inference.generate_task_repaint_inference(
        dit, vae, tokenizer, [{"question": key, "id": i} for i, key in enumerate(prompts)], task_name="ids",
        device=torch.device("cpu"), timestep_num=args.timestep_num, guidance_scale=args.guidance_scale,
        max_new_tokens=args.max_new_tokens, temperature=0.0, repetition_penalty=args.repetition_penalty,
        pad_token_id=pad, eos_token_id=None)
    reference = load_file(str(folder / "reference_outputs.safetensors"))
    reference = {k: v for k, v in reference.items() if not k.startswith("generate_")}
    for i, key in enumerate(prompts):
        reference[f"generate_prompt{i}"] = torch.tensor(prompts[key])
        reference[f"generate_tokens{i}"] = torch.tensor(tokenizer.outputs[i])
        latents = encoded[0].latents_list[i]
        reference[f"generate_prompt_latents{i}"] = (latents - vae.shifting_factor) * vae.scaling_factor
    reference["generate_row_seeds"] = torch.tensor([args.noise_seed + 1000 * i for i in range(len(prompts))])
    reference["generate_guidance_scale"] = torch.tensor(args.guidance_scale)
    reference["generate_num_steps"] = torch.tensor(args.timestep_num)
    reference["generate_repetition_penalty"] = torch.tensor(args.repetition_penalty)
    save_file(reference, str(folder / "reference_outputs.safetensors"))
    note_path = folder / "reference_outputs.json"
    note = json.loads(note_path.read_text())
    note["generate"] = {
        "note": "generate_tokens{i} = cola_dlm.inference.generate_task_repaint_inference(dit, vae, prompts "
                "generate_prompt{i} as one batch, greedy, eos_token_id=None) in float32, the prompt's re-decoded "
                "tail trimmed; generate_prompt_latents{i} = (vae.encode's posterior mode - shifting_factor) * "
                "scaling_factor of the prompt filled with pad ids to whole blocks, as the inference encodes it; "
                "row i's block n starts from torch.randn(block, latent, generator seeded "
                "generate_row_seeds[i] + n * 10_000_000)",
        "arguments": {name: getattr(args, name) for name in ("seed", "generate_lengths", "max_new_tokens",
                                                             "guidance_scale", "timestep_num",
                                                             "repetition_penalty", "noise_seed")}}
    note_path.write_text(json.dumps(note, indent=1) + "\n")
    print(f"added the official generation to {folder}")
    return 0


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(Path(args.official_clone).resolve()))
    import transformers
    from cola_dlm.configuration_cola_dit import ColaDiTConfig
    from cola_dlm.configuration_cola_vae import ColaTextVAEConfig
    from cola_dlm.modeling_cola_dit import ColaDiTModel
    from cola_dlm.modeling_cola_vae import ColaTextVAEModel

    if args.checkpoint:
        return record_generation(args)
    if args.count_released_sizes:
        with torch.device("meta"):
            for name, module in (("VAE", ColaTextVAEModel(ColaTextVAEConfig())), ("DiT", ColaDiTModel(ColaDiTConfig()))):
                print(f"official {name}: {sum(p.numel() for p in module.parameters()):,} parameters")
        return 0
    if args.output_dir is None:
        raise SystemExit("--output-dir is required")
    torch.manual_seed(args.seed)
    pad = args.vocab_size - 1
    vae = ColaTextVAEModel(ColaTextVAEConfig(
        vocab_size=args.vocab_size, encoder_num_blocks=args.encoder_blocks, decoder_num_blocks=args.decoder_blocks,
        dim=args.dim, ffn_dim=args.ffn_dim, latent_dim=args.latent_dim, num_heads=args.num_heads,
        shared_heads_kv=args.shared_heads_kv, block_size=args.vae_block_size, rope_theta=args.rope_theta,
        layer_norm_eps=args.layer_norm_eps, scaling_factor=args.scaling_factor,
        shifting_factor=args.shifting_factor, pad_token_id=pad, eos_token_id=2)).eval()
    dit = ColaDiTModel(ColaDiTConfig(
        txt_in_channels=args.latent_dim, txt_out_channels=args.latent_dim, txt_dim=args.txt_dim, emb_dim=args.txt_dim,
        heads=args.heads, head_dim=args.head_dim, expand_ratio=args.expand_ratio, num_layers=args.num_layers,
        norm_eps=args.norm_eps, rope_dim=args.rope_dim, block_size=args.block_size)).eval()
    with torch.no_grad():
        for module in (vae, dit):
            for parameter in module.parameters():
                parameter.add_(torch.randn_like(parameter) * args.perturb_std)

    out = Path(args.output_dir)
    vae.save_pretrained(out / "cola_vae")
    dit.save_pretrained(out / "cola_dit")

    lengths = args.row_lengths
    if any(n % args.block_size for n in lengths):
        raise SystemExit(f"--row-lengths must be multiples of --block-size ({args.block_size})")
    rows = [torch.randint(0, args.vocab_size - 1, (n,)) for n in lengths]
    shape = torch.tensor([[n] for n in lengths])
    record = {}
    with torch.no_grad():
        encoded = vae.encode(rows)
        for i, (row, dist) in enumerate(zip(rows, encoded.latent_dists)):
            record[f"row{i}_ids"] = row
            record[f"row{i}_mean"], record[f"row{i}_logvar"] = dist.mean, dist.logvar
        latents = torch.randn(sum(lengths), args.latent_dim)
        record["decode_latents"] = latents
        record["decode_logits"] = vae.decode(latents, txt_shape=shape, txt_q_shape=shape)[0]
        # The conditional pass the official generator makes for each row's last block: its history clean (t = 0).
        dit_input = torch.randn(sum(lengths), args.latent_dim)
        timestep = torch.zeros(sum(lengths))
        ends = torch.tensor(lengths).cumsum(0).tolist()
        for end in ends:
            timestep[end - args.block_size:end] = args.time
        record["dit_input"], record["dit_timestep"] = dit_input, timestep
        record["dit_velocity"] = dit(txt=dit_input, txt_shape=shape, txt_q_shape=shape, timestep=timestep).txt_sample
        # The unconditional branch: each row's last block alone.
        blocks = torch.cat([dit_input[end - args.block_size:end] for end in ends])
        block_shape = torch.tensor([[args.block_size]] * len(lengths))
        record["dit_uncond_input"] = blocks
        record["dit_uncond_velocity"] = dit(txt=blocks, txt_shape=block_shape, txt_q_shape=block_shape,
                                            timestep=torch.full((blocks.shape[0],), args.time)).txt_sample
    save_file({k: v.contiguous() for k, v in record.items()}, str(out / "reference_outputs.safetensors"))
    note = {"note": f"official code's outputs on this checkpoint, rows of {lengths} tokens concatenated; "
                    f"rowN_mean/logvar = vae.encode(rows).latent_dists[N]; decode_logits = vae.decode(decode_latents, "
                    f"txt_shape=txt_q_shape=row lengths); dit_velocity = dit(dit_input, same shapes, timestep="
                    f"dit_timestep: history 0, each row's last block of {args.block_size} at {args.time:g}); "
                    f"dit_uncond_velocity = dit on those last blocks alone",
            "transformers": transformers.__version__, "torch": torch.__version__, "arguments": vars(args)}
    note["arguments"].pop("official_clone")
    note["arguments"].pop("output_dir")
    (out / "reference_outputs.json").write_text(json.dumps(note, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
