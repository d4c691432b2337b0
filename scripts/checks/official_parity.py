"""Compare a converted official checkpoint with the official code's outputs.

    python scripts/checks/official_parity.py --family calm --model CONVERTED_DIR --reference FILE.safetensors

FILE holds the official inputs and outputs (the keys of ../shared/reference/*/reference_outputs.safetensors, any
sizes; scripts/checks/official_reference_calm.py and official_reference_cola.py write more of them). Prints one line
per quantity, `NAME max_abs_diff=X`, in fp32, and exits 1 if any X exceeds --tolerance (1e-5).

`--mark-verified` (Cola): when every quantity is within tolerance, adds this machine's bf16 kernels (and the
thread count) to the list `bf16_parity_verified_on` of the reference's .json; tests/official holds the bf16
outputs to 1e-5 on the machines listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=["calm", "cola"])
    parser.add_argument("--model", required=True, help="a folder written by `hf-latentlm convert`")
    parser.add_argument("--reference", required=True, help="a safetensors file of official inputs and outputs")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--mark-verified", action="store_true", help="cola: record this machine's bf16 kernels")
    args = parser.parse_args(argv)

    from safetensors.torch import load_file

    reference = load_file(args.reference)
    if args.family == "calm":
        from hf_latentlm.modeling.modeling_calm import CALMForCausalLM
        from hf_latentlm.official.calm import calm_parity

        diffs = calm_parity(CALMForCausalLM.from_pretrained(args.model), reference)
    else:
        from hf_latentlm.modeling.modeling_cola import ColaForCausalLM
        from hf_latentlm.official.cola import cola_parity

        diffs = cola_parity(ColaForCausalLM.from_pretrained(args.model), reference)
    for name, diff in diffs.items():
        print(f"{name} max_abs_diff={diff:.3g}")
    failed = [name for name, diff in diffs.items() if not diff <= args.tolerance]
    if failed:
        print(f"above {args.tolerance:g}: {', '.join(failed)}", file=sys.stderr)
    elif args.mark_verified and args.family == "cola":
        from hf_latentlm.official.cola import bf16_kernels

        note_path = Path(args.reference).with_suffix(".json")
        note = json.loads(note_path.read_text())
        verified = note.setdefault("bf16_parity_verified_on", [])
        if bf16_kernels() not in verified:
            verified.append(bf16_kernels())
        note_path.write_text(json.dumps(note, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
