"""Issue 33, item 5: every language-model family's training and decoding speed on one GPU, next to the AR baseline
and to the same AR model under transformers' static cache + compile. Prepared to run within one device call.

    python scripts/experiments/gpu_speed.py --peak-tflops 989 --output results/gpu_speed/gpu_speed.json \
        [--presets small base] [--batch-sizes 1 8 64] [--plm runs/plm-small]

(989 TFLOP/s: an H200's dense bf16 peak; give the device's own.) For each preset and each family of the registry
that generates text, a fresh model (seed 0; fresh components too), its weights in `--dtype` (no autocast), on
`--device`:
  * training: `fresh_training_step_time` on the preset's batch of train-split rows (`--train-steps` timed steps after
    a warm-up) -> tokens/s, and MFU = counted training FLOPs per token (`counted_training_flops`) x tokens/s / peak;
  * decoding: `measure_generation_speed` at each batch size (64-token validation prompts, `--new-tokens` new tokens,
    EOS ignored; eager), and compiled (`compiled_decoding_speed`: CUDA graphs on a GPU) for AR, with the static cache
    ("stock Llama compiled"), and for `--compile-families` (default PLM, whose eager Voronoi fit is hundreds of
    small kernel launches a call).
Speed does not depend on the weights when EOS is ignored, except PLM's tokens per call: `--plm DIR` adds a trained
PLM's decoding row (what the issue's "post-trained PLM ≥ 2x AR at batch 1" target is about). Every timer waits for
the GPU (`speed.synchronize`). Rows print as they finish, so a run cut short by the device's time limit keeps them.
Checked on the CPU with `--device cpu --dtype float32 --presets tiny --batch-sizes 1 2 --train-steps 1
--new-tokens 8 --repeats 1 --peak-tflops 1` (25 s) and the same with `--dtype bfloat16` (70 s); never on a GPU. If
one device call (10 minutes) is too short for both presets, run `--presets small` and `--presets base` (or subsets
of `--families`) as separate calls with separate `--output` files.
"""

import argparse
import json
import sys
import time

import torch

from hf_latentlm.eval.flops import counted_training_flops
from hf_latentlm.eval.harness import nll_rows, split_stream
from hf_latentlm.eval.speed import compiled_decoding_speed, fresh_training_step_time, measure_generation_speed
from hf_latentlm.families import BASELINE_FAMILY, FAMILIES, build_fresh_model
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.presets import get_preset
from hf_latentlm.training.corpus import load_default_tokenizer

PROMPT_LEN = 64


def decoding_rows(model, prompts, batch_sizes, new_tokens: int, repeats: int) -> dict:
    return {f"batch_{b}": measure_generation_speed(model, prompts[:b], new_tokens, repeats) for b in batch_sizes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--presets", nargs="+", default=["small", "base"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, required=True, help="the device's dense peak in --dtype")
    parser.add_argument("--families", nargs="+", default=None, help="default: every language-model family")
    parser.add_argument("--compile-families", nargs="*", default=["plm"],
                        help="families also timed with compiled decoding (AR always is, with the static cache)")
    parser.add_argument("--plm", default=None, help="a trained PLM folder: its decoding at the first preset's sizes")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokenizer = load_default_tokenizer()
    validation = split_stream(tokenizer, "validation")
    prompts = nll_rows(validation, PROMPT_LEN)[:max(args.batch_sizes)].to(device)
    if len(prompts) < max(args.batch_sizes):
        raise SystemExit(f"the validation split has {len(prompts)} prompts of {PROMPT_LEN} tokens, fewer than "
                         f"batch size {max(args.batch_sizes)}")
    families = args.families or [BASELINE_FAMILY, *(n for n, spec in FAMILIES.items()
                                                    if spec.language_model and n != BASELINE_FAMILY)]
    unknown = [f for f in families if f not in FAMILIES or not FAMILIES[f].language_model]
    if unknown:
        raise SystemExit(f"--families: {unknown} are not language-model families of the registry")
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "peak_tflops": args.peak_tflops, "torch": torch.__version__, "rows": []}

    def record(row: dict) -> None:
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.output, "w") as handle:
            json.dump(result, handle, indent=1)

    for preset_name in args.presets:
        preset = get_preset(preset_name)
        rows = nll_rows(split_stream(tokenizer, "train"), preset.seq_len)[:(args.train_steps + 1) * preset.batch_size]
        rows = rows.to(device)
        for family in families:
            model = build_fresh_model(family, preset, tokenizer).to(device=device, dtype=dtype)
            start = time.perf_counter()
            training = fresh_training_step_time(model, rows, args.train_steps, preset.batch_size)
            flops = counted_training_flops(model, rows[:preset.batch_size])["per_token"]
            training["flops_per_token"] = flops
            training["mfu"] = flops * training["tokens_per_s"] / (args.peak_tflops * 1e12)
            decoding = decoding_rows(model, prompts, args.batch_sizes, args.new_tokens, args.repeats)
            row = {"preset": preset_name, "family": family, "training": training, "decoding": decoding}
            if family == BASELINE_FAMILY or family in args.compile_families:
                # `generate(compile_config=...)`; AR as stock transformers does it, with the static cache
                row["decoding_compiled"] = compiled_decoding_speed(
                    model, prompts, tuple(args.batch_sizes), args.new_tokens, args.repeats,
                    static_cache=family == BASELINE_FAMILY)["compiled"]
            row["wall_s"] = time.perf_counter() - start
            record(row)
            del model
        if args.plm and preset_name == args.presets[0]:
            plm, _ = load_model_and_tokenizer(args.plm)
            plm = plm.to(device=device, dtype=dtype)
            row = {"preset": preset_name, "family": "plm", "model": args.plm,
                   "decoding": decoding_rows(plm, prompts, args.batch_sizes, args.new_tokens, args.repeats)}
            if "plm" in args.compile_families:
                row["decoding_compiled"] = compiled_decoding_speed(
                    plm, prompts, tuple(args.batch_sizes), args.new_tokens, args.repeats)["compiled"]
            record(row)
            del plm


if __name__ == "__main__":
    main()
