"""Evaluate the 'after' recipes (AURORA residual autoencoder, Cola frozen VAE) at 1x AR's compute on generated:medium,
decoded without guidance, 1500 windows x 2 pairs (fewer than the x1 runs' 4000: time)."""
import json, sys, time
from hf_latentlm.data.generated import GeneratedLanguage
from hf_latentlm.eval.optimum import evaluate_against_optimum
from hf_latentlm.loading import load_model_and_tokenizer
L = GeneratedLanguage.from_level("medium")
runs = {"runs/generated-medium-residual/aurora-x1": {"self_condition_guidance": 1.0, "guidance_scale": 1.0},
        "runs/generated-medium-frozen/cola-x1-frozen-vae": {"guidance_scale": 1.0}}
for folder, options in runs.items():
    model, _ = load_model_and_tokenizer(folder)
    t = time.perf_counter()
    o = evaluate_against_optimum(model.eval(), L, 1500, 128, seed=0, pairs=2, generate_kwargs=options)
    o["eval_seconds"] = time.perf_counter() - t; o["decoding"] = options
    json.dump(o, open(f"{folder}/optimum-noguidance-1500.json", "w"), indent=1)
    g = o["gap_closed"]
    print(folder, {k: [round(100 * g[k][x], 1) for x in ("value", "ci_low", "ci_high")] for k in g}, round(o["eval_seconds"]), flush=True)
