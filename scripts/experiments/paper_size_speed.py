"""Decoding speed at the papers' sizes on this machine: the official CALM-M (with its autoencoder) and Cola DLM 2B
(text VAE + DiT), each next to a Llama with the same non-embedding parameter count, fresh weights (speed does not
depend on them when EOS is ignored).

    python scripts/experiments/paper_size_speed.py --output results/official_checkpoints/paper_size_speed.json \
        [--models calm-m llama-for-calm-m cola-2b llama-for-cola-2b] [--batch-sizes 1 8] [--new-tokens 32]

Each model is built and timed in its own child process, so its peak resident memory (`ru_maxrss`) is its own.
Tokens/s = new tokens over all rows / median wall time of `--repeats` seeded `generate()` calls after two warm-ups
(`hf_latentlm.eval.speed.measure_generation_speed`), on 64-token prompts of random ids, in fp32.
"Non-embedding" leaves out every parameter with a vocabulary-sized dimension (input embeddings, output layers).
The Llama twin takes the latent model's backbone width, MLP width and heads, and the layer count that brings its
non-embedding count nearest to the latent model's (every network that runs while decoding counted).
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT_LEN = 64


def latent_model(name: str):
    if name == "calm-m":
        from hf_latentlm.modeling.modeling_calm import CALMForCausalLM
        from hf_latentlm.official.calm import official_calm_config

        return CALMForCausalLM(official_calm_config("calm-m"))
    if name == "cola-2b":
        from hf_latentlm.modeling.modeling_cola import ColaForCausalLM
        from hf_latentlm.official.cola import cola_2b_config

        return ColaForCausalLM(cola_2b_config())
    raise ValueError(f"unknown model {name!r}")


def non_embedding(model, vocab_size: int) -> int:
    return sum(p.numel() for p in model.parameters() if vocab_size not in p.shape)


def backbone_config(model):
    """The transformer that predicts latents (CALM's backbone, Cola's DiT): its config fields."""
    config = model.config
    prior = getattr(config, "dit_config", None) or getattr(config, "prior_config", None)
    return prior if prior is not None else config


def llama_twin(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        latent = latent_model(name)
    target = non_embedding(latent, latent.config.vocab_size)
    source = backbone_config(latent)
    get = (lambda key: source[key]) if isinstance(source, dict) else (lambda key: getattr(source, key))

    def config(layers):
        return LlamaConfig(vocab_size=latent.config.vocab_size, hidden_size=get("hidden_size"),
                           intermediate_size=get("intermediate_size"), num_hidden_layers=layers,
                           num_attention_heads=get("num_attention_heads"),
                           num_key_value_heads=get("num_key_value_heads"), max_position_embeddings=4096,
                           tie_word_embeddings=False)

    def count(layers):
        with torch.device("meta"):
            return non_embedding(LlamaForCausalLM(config(layers)), latent.config.vocab_size)

    per_layer = count(2) - count(1)
    layers = max(1, round((target - count(1)) / per_layer) + 1)
    return LlamaForCausalLM(config(layers)), {"matches": name, "target_non_embedding": target, "layers": layers}


def measure(name: str, batch_sizes: list[int], new_tokens: int, repeats: int) -> dict:
    from hf_latentlm.eval.speed import measure_generation_speed

    torch.manual_seed(0)
    start = time.perf_counter()
    if name.startswith("llama-for-"):
        model, extra = llama_twin(name.removeprefix("llama-for-"))
    else:
        model, extra = latent_model(name), {}
    model = model.float().eval()
    row = {"model": name, "class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
           "non_embedding": non_embedding(model, model.config.vocab_size), "build_s": time.perf_counter() - start,
           **extra, "speed": {}}
    generator = torch.Generator().manual_seed(1)
    for batch in batch_sizes:
        prompts = torch.randint(10, model.config.vocab_size, (batch, PROMPT_LEN), generator=generator)
        with torch.inference_mode():
            result = measure_generation_speed(model, prompts, max_new_tokens=new_tokens, repeats=repeats)
        row["speed"][batch] = {key: result[key] for key in ("tokens_per_s", "median_s", "times_s",
                                                             "model_calls_per_token", "flops_per_token")}
        print(f"{name} batch {batch}: {result['tokens_per_s']:.2f} tokens/s", file=sys.stderr, flush=True)
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["calm-m", "llama-for-calm-m", "cola-2b", "llama-for-cola-2b"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="results/official_checkpoints/paper_size_speed.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: measure this model, print its row
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.batch_sizes, args.new_tokens, args.repeats)))
        return
    rows = []
    for name in args.models:
        child = subprocess.run([sys.executable, __file__, "--one", name, "--new-tokens", str(args.new_tokens),
                                "--repeats", str(args.repeats), "--batch-sizes", *map(str, args.batch_sizes)],
                               capture_output=True, text=True, timeout=3600)
        if child.returncode:
            sys.exit(f"{name} failed:\n{child.stderr[-3000:]}")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    record = {"command": "python " + " ".join(sys.argv), "torch_threads": torch.get_num_threads(),
              "device": "cpu", "dtype": "float32", "prompt_len": PROMPT_LEN, "new_tokens": args.new_tokens,
              "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'model':<20}{'params':>14}{'non-emb':>14}" + "".join(f"{f'tok/s b{b}':>12}" for b in args.batch_sizes)
          + f"{'peak GiB':>10}")
    for row in rows:
        print(f"{row['model']:<20}{row['parameters']:>14,}{row['non_embedding']:>14,}"
              + "".join(f"{row['speed'][str(b)]['tokens_per_s']:>12.2f}" for b in args.batch_sizes)
              + f"{row['peak_rss_gib']:>10.2f}")


if __name__ == "__main__":
    main()
