"""`transformers.pipeline("text-generation", trust_remote_code=True)` for every multi-token family, in a process
where the package cannot be imported: the continuation equals the model's own generate() under the same seed (so
the pipeline's default temperature 0.7 did not reach the family), `return_full_text` prepends the prompt, and a
streamer receives the same text."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import family_contract as contract

LOADER = Path(__file__).parent / "isolated_pipeline.py"
PROMPT = "KING HENRY.\nWhat"


def test_text_generation_pipeline_runs_every_family_from_its_checkpoint(tokenizer, tmp_path):
    checkpoints = []
    for family in contract.multi_token_families():
        model = contract.build_tiny(family, tokenizer).eval()
        folder = tmp_path / family
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        checkpoints.append(str(folder))
    paths = sysconfig.get_paths()
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-S", str(LOADER), paths["purelib"], paths["platlib"], PROMPT, "6",
                           *checkpoints], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["checkpoint"] for r in results] == checkpoints
    for result in results:
        assert result["module"].startswith("transformers_modules"), result  # the checkpoint's own code ran
        assert result["continuation"] == result["generate"], result
        assert result["continuation"].strip(), result  # six tokens of an untrained model still decode to text
        assert result["full"] == PROMPT + result["continuation"], result
        assert result["streamed"] == result["continuation"], result
