"""Write an official-format CALM checkpoint and the official code's outputs on fixed inputs (data for
scripts/checks/official_parity.py and tests/official/).

Runs in its OWN environment, with what the official code pins (transformers 4.43, torch), and imports the official
package from a clone you name; nothing of it is copied here. Example:

    python -m venv /tmp/calm-env && /tmp/calm-env/bin/pip install torch==2.13.0 transformers==4.43.0 safetensors
    /tmp/calm-env/bin/python scripts/checks/official_reference_calm.py --official-clone /path/to/shaochenze/calm \
        --output-dir tests/fixtures/official/calm_heldout --hidden-size 40 --num-heads 5 --num-kv-heads 5 ...

Without --model/--autoencoder it builds a tiny model of the given sizes, perturbs every parameter by Gaussian noise
(so zero-initialised layers are not zero) and saves it the way the official trainer does (`pytorch_model.bin`,
`generative_head.*` aliases and the autoencoder as `ae_model.*` included). It then records, in
`reference_outputs.safetensors`: the autoencoder's posterior and decoder logits, the backbone's hidden states, the
energy head's samples for given noise, the energy loss with its recorded draws, and `generate()` at T = 1 and
T = 1/2 with every random number it drew.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official-clone", required=True, help="a clone of shaochenze/calm")
    parser.add_argument("--output-dir", required=True)
    # Sizes, ids and the perturbation: the defaults make the shared reference; other values make held-out ones.
    sizes = {"seed": 0, "vocab-size": 67, "chunk-size": 4, "latent-size": 24, "ae-hidden-size": 48,
             "ae-intermediate-size": 80, "ae-encoder-layers": 4, "ae-decoder-layers": 2, "ae-rms-norm-eps": 1e-6,
             "hidden-size": 32, "intermediate-size": 72, "num-layers": 2, "num-heads": 4, "num-kv-heads": 2,
             "noise-size": 12, "num-mlp-layers": 3, "rope-theta": 500000.0, "rms-norm-eps": 1e-5,
             "perturb-std": 0.05, "pad-token-id": 0, "bos-token-id": 1, "eos-token-id": 2}
    for name, default in sizes.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    parser.add_argument("--without-autoencoder-folder", action="store_true",
                        help="keep only the CALM folder (its autoencoder is inside, as ae_model.*)")
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--generate-chunks", type=int, default=4)
    return parser.parse_args()


def build(args, models, folder: Path):
    """A perturbed official autoencoder and CALM, saved as the official code saves them; returns both."""
    ae_dir, calm_dir = folder / "autoencoder", folder / "calm"
    ae_config = models.AutoencoderConfig(
        vocab_size=args.vocab_size, hidden_size=args.ae_hidden_size, intermediate_size=args.ae_intermediate_size,
        num_encoder_layers=args.ae_encoder_layers, num_decoder_layers=args.ae_decoder_layers,
        latent_size=args.latent_size, patch_size=args.chunk_size, rms_norm_eps=args.ae_rms_norm_eps,
        pad_token_id=args.pad_token_id, bos_token_id=args.bos_token_id, eos_token_id=args.eos_token_id)
    autoencoder = models.Autoencoder(ae_config)
    perturb(autoencoder, args.perturb_std)
    autoencoder.save_pretrained(ae_dir, safe_serialization=False)
    config = models.CALMConfig(
        ae_path=str(ae_dir), vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads, patch_size=args.chunk_size,
        latent_size=args.latent_size, noise_size=args.noise_size, num_mlp_layers=args.num_mlp_layers,
        rope_theta=args.rope_theta, rms_norm_eps=args.rms_norm_eps, max_position_embeddings=512,
        pad_token_id=args.pad_token_id, bos_token_id=args.bos_token_id, eos_token_id=args.eos_token_id)
    model = models.EnergyTransformer(config)
    perturb(model, args.perturb_std, skip="ae_model.")  # its autoencoder is the frozen one saved above
    model.config.ae_path = "/path/to/the/autoencoder"  # a real checkpoint holds the training machine's path
    calm_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(calm_dir)
    torch.save(model.state_dict(), calm_dir / "pytorch_model.bin")  # as the official trainer: aliases included
    if args.without_autoencoder_folder:
        shutil.rmtree(ae_dir)
    return autoencoder.eval(), model.eval()


@torch.no_grad()
def perturb(module: torch.nn.Module, std: float, skip: str | None = None) -> None:
    for name, parameter in module.named_parameters():
        if skip is None or not name.startswith(skip):
            parameter.add_(torch.randn_like(parameter) * std)


class Recorder:
    """Records every torch.rand / torch.randn / random.random value while active."""

    def __init__(self, replace_rand=None):
        self.rand, self.randn, self.python = [], [], []
        self.replace_rand = replace_rand

    def __enter__(self):
        self.saved = torch.rand, torch.randn
        rand, randn = self.saved

        def recording_rand(*a, **k):
            out = self.replace_rand.pop(0) if self.replace_rand else rand(*a, **k)
            self.rand.append(out.clone())
            return out

        def recording_randn(*a, **k):
            out = randn(*a, **k)
            self.randn.append(out.clone())
            return out

        def recording_random():
            value = self.saved_random()
            self.python.append(value)
            return value

        torch.rand, torch.randn = recording_rand, recording_randn
        self.saved_random = random._inst.random
        random._inst.random = recording_random
        return self

    def __exit__(self, *exc):
        torch.rand, torch.randn = self.saved
        del random._inst.random


@torch.no_grad()
def record(args, autoencoder, model) -> dict[str, torch.Tensor]:
    K, B, n = args.chunk_size, args.rows, args.chunks
    out = {}
    ids = torch.randint(3, args.vocab_size, (B, n * K))
    out["input_ids"] = ids
    mean, log_std = torch.chunk(model.ae_model.encoder(input_ids=ids), 2, dim=-1)
    out["ae_mean"], out["ae_log_std"] = mean, log_std
    out["ae_z"] = torch.randn(B, n, args.latent_size)
    out["ae_logits"] = model.ae_model.decoder(latent_states=out["ae_z"])
    embeds = model.embed_proj(model.transformer.embed_tokens(ids).reshape(B, n, -1))
    hidden = model.transformer(inputs_embeds=embeds)[0]
    out["calm_hidden"] = hidden
    samples = 3
    noise = torch.rand(B, n, samples, args.noise_size) - 0.5
    with Recorder(replace_rand=[noise + 0.5]):
        out["head_samples"] = model.generative_head.sample(hidden.unsqueeze(2).repeat(1, 1, samples, 1))
    out["head_noise"] = noise
    with Recorder() as recorder:
        loss = model(input_ids=ids, labels=ids.clone()).loss
    out["energy_loss"] = loss.reshape(())
    # The loss's own draws come first (its evaluation mode then estimates Brier scores with more draws).
    out["energy_model_noise"], out["energy_target_noise"] = recorder.rand[0], recorder.randn[0]
    for name, temperature in (("generate_t1", 1.0), ("generate_t05", 0.5)):
        out.update(record_generate(model, ids[:, :2 * K], temperature, args.generate_chunks, name))
    return out


def record_generate(model, prompt, temperature: float, steps: int, name: str) -> dict[str, torch.Tensor]:
    """The official `generate()` with every draw recorded, in the order it made them, and the raw chunk of each step
    (before the official code pads finished rows)."""
    chunks, draws = [], []
    sampling = model.temperature_sampling

    def recording_sampling(hidden_states, temperature=0.5, num_samples=200):
        before = len(recorder.rand), len(recorder.python)
        chunk = sampling(hidden_states, temperature=temperature, num_samples=num_samples)
        noise = recorder.rand[before[0]:]
        assert len(noise) == 1, "one noise draw per step"
        draws.append(noise[0].reshape(prompt.shape[0], -1, noise[0].shape[-1]))
        if temperature != 1.0:
            draws.append(torch.tensor(recorder.python[before[1]:], dtype=torch.float64))
        chunks.append(chunk)
        return chunk

    model.temperature_sampling = recording_sampling
    try:
        with Recorder() as recorder:
            model.generate(prompt, max_length=prompt.shape[1] + steps * model.patch_size, temperature=temperature)
    finally:
        del model.temperature_sampling
    out = {f"{name}_prompt": prompt, f"{name}_tokens": torch.cat(chunks, dim=1),
           f"{name}_temperature": torch.tensor(temperature)}
    out.update({f"{name}_draw_{i}": d for i, d in enumerate(draws)})
    return out


def main():
    args = parse_args()
    sys.path.insert(0, args.official_clone)
    # The official package (shaochenze/calm/models, a namespace package).
    from models.configuration_autoencoder import AutoencoderConfig
    from models.configuration_calm import CALMConfig
    from models.modeling_autoencoder import Autoencoder
    from models.modeling_energy import EnergyTransformer
    models = argparse.Namespace(AutoencoderConfig=AutoencoderConfig, Autoencoder=Autoencoder, CALMConfig=CALMConfig,
                                EnergyTransformer=EnergyTransformer)

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    folder = Path(args.output_dir)
    autoencoder, model = build(args, models, folder)
    outputs = record(args, autoencoder, model)
    save_file({k: v.contiguous() for k, v in outputs.items()}, folder / "reference_outputs.safetensors")
    (folder / "reference_outputs.json").write_text(json.dumps({
        "made_by": "scripts/checks/official_reference_calm.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "keys": {k: list(v.shape) for k, v in outputs.items()}}, indent=1) + "\n")
    print(f"wrote {folder}: {len(outputs)} tensors")


if __name__ == "__main__":
    main()
