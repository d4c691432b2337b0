"""MAUVE calibration on the embedded corpus: 400 human validation chunks of 128 tokens vs 400 other
chunks (same distribution), the same chunks word-shuffled, and looped text.

    SEEDS=0 python scripts/experiments/mauve_calibration.py hf_latentlm/data
"""
import json, lzma, os, random, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
data = sys.argv[1]
from transformers import AutoTokenizer
from hf_latentlm.eval.mauve import mauve_score, offline_sentence_encoder, embed_texts

tok = AutoTokenizer.from_pretrained(os.path.join(data, "tokenizer"))
recs = [json.loads(l) for l in lzma.open(os.path.join(data, "shakespeare.jsonl.xz"), "rt")]
val = [r for r in recs if r["split"] == "validation"]
chunks = []
for r in val:
    ids = tok(r["text"], add_special_tokens=False)["input_ids"]
    for i in range(0, len(ids) - 128 + 1, 128):
        chunks.append(tok.decode(ids[i:i + 128]))
print("validation works", [r["name"] for r in val], "chunks of 128 tokens:", len(chunks))
SEEDS = [int(s) for s in os.environ.get("SEEDS", "0,1,2").split(",")]
rng = random.Random(0)
rng.shuffle(chunks)
human, other = chunks[:400], chunks[400:800]
print("mean words/chunk", sum(len(c.split()) for c in human) / 400)

t0 = time.time(); enc = offline_sentence_encoder(); t_load = time.time() - t0
t0 = time.time(); embed_texts(human + other, enc); t_emb = time.time() - t0
print(f"encoder load {t_load:.1f}s, embedding 800 chunks {t_emb:.1f}s")

def shuffled(c, r):
    w = c.split(); r.shuffle(w); return " ".join(w)
r2 = random.Random(1)
cases = {
    "same distribution": other,
    "word-shuffled": [shuffled(c, r2) for c in other],
    "repetitive (first 8 words of each chunk looped)": [
        " ".join((c.split()[:8] * 20)[: len(c.split())]) for c in other],
    "repetitive (one phrase, identical texts)": ["I know not what to say. " * 20] * 400,
}
for name, model in cases.items():
    for seed in SEEDS:
        t0 = time.time()
        out = mauve_score(model, human, encoder=enc, seed=seed)
        print(f"{name:50s} seed={seed} mauve={out['mauve']:.3f} mauve*={out['mauve_star']:.3f} "
              f"buckets={out['num_buckets']} ({time.time() - t0:.1f}s)")
