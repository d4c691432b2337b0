"""The tokens a PLM decodes, saved to compare two versions of the code; or the comparison of two such files.

    PYTHONPATH=/path/to/old/checkout python scripts/experiments/plm_decoded_tokens.py runs/plm-small old.json
    python scripts/experiments/plm_decoded_tokens.py runs/plm-small new.json
    python scripts/experiments/plm_decoded_tokens.py --compare old.json new.json

Eight 64-token validation prompts (starting every 300 tokens), 96 new tokens each (EOS ignored), one process run per
acceptance rule (exact, nucleus), auxiliary seed i for prompt i. The comparison prints, per rule, how many rows are
identical and the index of each row's first differing token.
"""

import argparse
import json

import torch


def decode(folder: str, out: str) -> None:
    from hf_latentlm.eval.harness import split_stream
    from hf_latentlm.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(folder)
    model.eval()
    validation = split_stream(tokenizer, "validation")
    tokens = {}
    for acceptance in ("exact", "nucleus"):
        rows = []
        for i in range(8):
            prompt = validation[300 * i:300 * i + 64][None]
            sequence = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=96,
                                      min_new_tokens=96, eos_token_id=None, acceptance=acceptance,
                                      auxiliary_seeds=[i])
            rows.append(sequence[0, 64:].tolist())
        tokens[acceptance] = rows
    with open(out, "w") as f:
        json.dump(tokens, f)


def compare(first: str, second: str) -> None:
    with open(first) as f:
        a = json.load(f)
    with open(second) as f:
        b = json.load(f)
    for acceptance in a:
        pairs = list(zip(a[acceptance], b[acceptance]))
        differ = [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), None) for r, s in pairs]
        print(f"{acceptance}: {sum(d is None for d in differ)} of {len(pairs)} rows identical; "
              f"first differing token per row: {differ}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs=2, help="PLM folder and output file, or (--compare) two output files")
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()
    (compare if args.compare else decode)(*args.paths)


if __name__ == "__main__":
    main()
