"""Estimate the wall time of each README family example on this machine, without running every step.

For each `train` command of the README's "One example per family":
  run A: the command as written plus `--stop-at-step S` times S steps and one evaluation;
  run B: the command with `--max-steps 2` times the end of a run (final save and the after-training summary),
         and its folder stands in for a trained first stage (calm-ae, cola-vae, aurora-ae): a second stage's
         step time does not depend on the first stage's weights.
Each progress-bar update and output line is time-stamped as it arrives, so
  estimate = startup + max_steps * step_s + evaluations * eval_s + end_s
with startup (launch to the first step), step_s (between step 1 and step S of run A, per step), eval_s (step S to
its val_loss line) and end_s (run B's last val_loss line to its exit).

    .venv/bin/python scripts/experiments/time_readme_examples.py --output results/readme_examples_time/times.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

EXE = str(Path(sys.executable).with_name("hf-latentlm"))

# (name, README arguments, max_steps as run, eval_every as run, first-stage flag -> name of the run it needs)
EXAMPLES = [
    ("ar", ["--family", "ar", "--preset", "small", "--max-steps", "120", "--no-sample"], 120, 100, None),
    ("calm-ae", ["--family", "calm-ae", "--preset", "small", "--max-steps", "1500"], 1500, 100, None),
    ("calm", ["--family", "calm", "--preset", "small", "--max-steps", "600"], 600, 100, ("--autoencoder", "calm-ae")),
    ("cola-vae", ["--family", "cola-vae", "--preset", "small"], 300, 100, None),
    ("cola", ["--family", "cola", "--preset", "small"], 300, 100, ("--vae", "cola-vae")),
    ("aurora-ae", ["--family", "aurora-ae", "--preset", "small", "--seq-len", "128", "--batch-size", "32",
                   "--max-steps", "800"], 800, 100, None),
    ("aurora", ["--family", "aurora", "--preset", "small", "--seq-len", "128", "--batch-size", "32",
                "--max-steps", "600"], 600, 100, ("--autoencoder", "aurora-ae")),
]


def timed_run(arguments: list[str], timeout: float) -> tuple[float, list[tuple[float, str]]]:
    """Run `hf-latentlm train ARGS` with its progress bar; return its wall seconds and its output pieces (split at
    carriage returns and newlines) with their arrival times."""
    start = time.perf_counter()
    process = subprocess.Popen([EXE, "train", *arguments], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pieces, pending = [], b""
    try:
        while chunk := os.read(process.stdout.fileno(), 4096):
            stamp = time.perf_counter() - start
            *complete, pending = re.split(rb"[\r\n]", pending + chunk)
            pieces += [(stamp, piece.decode(errors="replace")) for piece in complete if piece]
            if stamp > timeout:
                raise TimeoutError(f"{arguments} ran past {timeout} s")
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    if process.returncode != 0:
        raise RuntimeError(f"{arguments} exited {process.returncode}:\n" + "\n".join(t for _, t in pieces[-20:]))
    return time.perf_counter() - start, pieces


def step_times(pieces) -> dict[int, float]:
    """When the progress bar first showed each completed step count."""
    times = {}
    for stamp, text in pieces:
        for done in re.findall(r"(\d+)/\d+ \[", text):
            times.setdefault(int(done), stamp)
    return times


def evaluation_times(pieces) -> list[float]:
    return [stamp for stamp, text in pieces if re.search(r"step \d+: val_loss", text)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stop-at-step", type=int, default=30)
    parser.add_argument("--workdir", default="/tmp/readme_examples_time")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results = {}
    selected = set(args.only or [name for name, *_ in EXAMPLES])
    first_stages = {needs[1] for name, *_, needs in EXAMPLES if name in selected and needs}
    for name, readme_args, max_steps, eval_every, needs in EXAMPLES:
        if name not in selected | first_stages:
            continue
        extra = [needs[0], str(work / f"{needs[1]}-b")] if needs else []
        wall_b, lines_b = timed_run([*readme_args, *extra, "--output-dir", str(work / f"{name}-b"),
                                     "--max-steps", "2"], timeout=1800)
        if name not in selected:
            continue
        wall_a, lines_a = timed_run([*readme_args, *extra, "--output-dir", str(work / f"{name}-a"),
                                     "--stop-at-step", str(args.stop_at_step)],
                                    timeout=3600)
        times = step_times(lines_a)
        # The bar counts the last step only after its evaluation, so time steps 1..S-1 and give the rest to it.
        first, last = 1, args.stop_at_step - 1
        step_s = (times[last] - times[first]) / (last - first)
        startup_s = times[first] - step_s
        eval_s = evaluation_times(lines_a)[-1] - times[last] - step_s
        end_s = wall_b - evaluation_times(lines_b)[-1]
        evaluations = max_steps // eval_every + (1 if max_steps % eval_every else 0)
        estimate_s = startup_s + max_steps * step_s + evaluations * eval_s + end_s
        results[name] = {"command": "hf-latentlm train " + " ".join(readme_args), "max_steps": max_steps,
                         "startup_s": round(startup_s, 1), "step_s": round(step_s, 3),
                         "eval_s": round(eval_s, 1), "evaluations": evaluations, "end_s": round(end_s, 1),
                         "estimate_min": round(estimate_s / 60, 1), "timed_steps": last - first,
                         "wall_clock": time.strftime("%Y-%m-%d %H:%M"),
                         "run_a_wall_s": round(wall_a, 1), "run_b_wall_s": round(wall_b, 1)}
        print(json.dumps({name: results[name]}), flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
