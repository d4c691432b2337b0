"""Seconds, new modules, and whether torch / transformers came with each import statement given (each in a fresh
interpreter): what `hf-latentlm COMMAND --help` pays before it answers.

    python scripts/checks/import_cost.py "from transformers import HfArgumentParser" "from trl import TrlParser" \
        "import hf_latentlm.cli"
"""

import subprocess
import sys

PROBE = """
import sys, time
before = set(sys.modules); start = time.perf_counter()
exec(sys.argv[1])
seconds = time.perf_counter() - start
print(f"{sys.argv[1]!r}: {seconds:.2f} s, {len(set(sys.modules) - before)} new modules, "
      f"torch={'torch' in sys.modules}, transformers={'transformers' in sys.modules}")
"""

for statement in sys.argv[1:]:
    subprocess.run([sys.executable, "-c", PROBE, statement], check=True, timeout=300)
