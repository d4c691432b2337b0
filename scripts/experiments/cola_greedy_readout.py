"""BrierLM-2 of Cola with a greedy VAE read-out (temperature 0) at w = 0 and w = 7, 1000 positions each:
    python scripts/experiments/cola_greedy_readout.py
(reads runs/cola-small-600, writes results/cola_vs_ar/cola_greedy_readout.json)"""
import json, time
from hf_latentlm.eval.brier import evaluate_brier
from hf_latentlm.eval.harness import split_stream
from hf_latentlm.loading import load_model_and_tokenizer
cola, tok = load_model_and_tokenizer("runs/cola-small-600")
stream = split_stream(tok, "validation")
out = {}
for w in (0.0, 7.0):
    t = time.time()
    b = evaluate_brier(cola, stream, 1000, generate_kwargs={"guidance_scale": w, "temperature": 0.0})
    out[f"w={w:g}, greedy read-out"] = {k: b[k] for k in ("brier_1", "brier_2", "brierlm_2")}
    print(w, b["brierlm_2"], b["brier_1"]["value"], round(time.time() - t), flush=True)
json.dump(out, open("results/cola_vs_ar/cola_greedy_readout.json", "w"), indent=1)
