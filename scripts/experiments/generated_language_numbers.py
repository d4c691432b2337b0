"""Each level's own numbers: entropy rate, the unigram's entropy, and the true language's and its unigram's
Brier-1..4 / BrierLM / BrierLM-2 with the harness's estimator (and the exact-target one) on the validation windows
`eval` uses (context 128). Cheap: numpy only.

    python scripts/experiments/generated_language_numbers.py --positions 20000
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from hf_latentlm.data.generated import LEVELS, GeneratedLanguage
from hf_latentlm.eval.bench import format_ci, markdown_table
from hf_latentlm.eval.brier import summarize_brier
from hf_latentlm.eval.optimum import REFERENCE_PAIRS, LanguageReference, evaluation_stream, optimum_position_terms


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=20000)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--output", default="runs/generated-language-numbers.json")
    args = p.parse_args()
    rows, record = [], {}
    for level in LEVELS:
        language = GeneratedLanguage.from_level(level)
        stream = evaluation_stream(language)
        u = language.unigram_probs()
        record[level] = {"entropy_rate": language.conditional_entropy(200_000),
                         "unigram_entropy": float(-np.sum(u[u > 0] * np.log(u[u > 0])))}
        for kind in ("true", "unigram"):
            plain, exact = optimum_position_terms(LanguageReference(language, kind), language, stream, args.positions,
                                                  args.context_len, batch_size=1000, pairs=REFERENCE_PAIRS)
            summary, exact_summary = summarize_brier(plain), summarize_brier(exact)
            record[level][kind] = {"harness": summary, "exact_target": exact_summary}
            rows.append([level, kind, *(format_ci(summary[f"brier_{n}"], 4) for n in range(1, 5)),
                         format_ci(summary["brierlm"], 2), format_ci(summary["brierlm_2"], 2),
                         format_ci(exact_summary["brierlm_2"], 2)])
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: {"entropy_rate": v["entropy_rate"], "unigram_entropy": v["unigram_entropy"]}
                      for k, v in record.items()}))
    print(markdown_table(["level", "model", "Brier-1", "Brier-2", "Brier-3", "Brier-4", "BrierLM", "BrierLM-2",
                          "BrierLM-2 (exact target)"], rows))


if __name__ == "__main__":
    main()
