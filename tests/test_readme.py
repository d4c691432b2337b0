"""The README as a new user reads it.

Every ```python block runs verbatim in a fresh interpreter, from a folder holding what the README's own
`hf-latentlm train` commands write (run at the `tiny` preset for one step instead of their full length); a block
followed by a ```text block must print exactly that. The command-line synopsis names exactly the parser's options.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hf_latentlm.cli import build_parser, component_names, config_overrides
from hf_latentlm.families import FAMILIES
from hf_latentlm.presets import PRESETS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
# (code, the printed output the README shows right after it, or "")
SNIPPETS = re.findall(r"```python\n(.*?)```(?:\n\n```text\n(.*?)```)?", README, flags=re.S)


def snippet_id(index: int) -> str:
    """The README section a snippet sits in, for the test id."""
    position = README.index(SNIPPETS[index][0])
    section = README[:position].rsplit("\n## ", 1)[-1].split("\n", 1)[0]
    return f"{index}-{section.split(' (')[0].lower().replace(' ', '-')}"


def train_commands() -> dict[str, argparse.Namespace]:
    """--output-dir -> parsed arguments of every `hf-latentlm train ... --output-dir DIR` in a ```bash block or an
    inline code span of the README, parsed by the real parser (an option that does not exist fails here)."""
    text = README.replace("\\\n", " ")  # shell line continuations
    bash = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    pieces = [line for block in bash for line in block.splitlines()]
    pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    commands = {}
    for piece in pieces:
        for match in re.finditer(r"hf-latentlm (train\b[^&;|]*)", piece):
            if "--output-dir" not in match.group(1):
                continue  # a mention of the command, not a command
            try:
                args = build_parser().parse_args(shlex.split(match.group(1)))
            except SystemExit:
                pytest.fail(f"the README command `hf-latentlm {match.group(1).strip()}` does not parse")
            commands[args.output_dir] = args
    return commands


class ReadmeFolders:
    """Writes, under `root`, the folder a README command makes, after the folders it needs (its components)."""

    def __init__(self, root: Path, rows):
        self.root, self.rows, self.commands, self.made = root, rows, train_commands(), set()

    def make(self, folder: str) -> None:
        from hf_latentlm.training.loop import TrainConfig, train

        if folder in self.made:
            return
        if folder not in self.commands:
            pytest.fail(f"a README snippet loads {folder!r}, which no `hf-latentlm train` command of the README "
                        f"writes (known: {sorted(self.commands)})")
        if Path(folder).is_absolute():
            pytest.fail(f"a README snippet loads the absolute folder {folder!r}: use a folder relative to where the "
                        f"command runs, so that snippets and commands work from any directory")
        args = self.commands[folder]
        components = {name: getattr(args, name) for name in component_names() if getattr(args, name)}
        for needed in components.values():
            self.make(needed)
        train(TrainConfig(family=args.family, preset="tiny", output_dir=str(self.root / folder), max_steps=1,
                          batch_size=2, eval_every=0, progress_bar=False, seed=args.seed,
                          components={name: str(self.root / path) for name, path in components.items()},
                          model_kwargs=config_overrides(args.config)),
              train_rows=self.rows)
        self.made.add(folder)


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory, tiny_rows) -> list[subprocess.CompletedProcess]:
    """Every snippet run as `python -c CODE` from a folder holding the models it loads, two at a time."""
    folders = ReadmeFolders(tmp_path_factory.mktemp("readme"), tiny_rows[:4].clone())
    for code, _ in SNIPPETS:
        saved = set(re.findall(r"save_pretrained\(\s*\"([^\"]+)\"", code))
        for folder in sorted(set(re.findall(r"from_pretrained\(\s*\"([^\"]+)\"", code)) - saved):
            folders.make(folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=folders.root, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=600)  # stdin closed: an interactive prompt fails

    # Each interpreter spends seconds importing torch and transformers: overlap them.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(run, [code for code, _ in SNIPPETS]))


def test_every_python_block_is_collected():
    assert len(SNIPPETS) == README.count("```python") >= 8


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=snippet_id)
def test_readme_snippet_runs_on_its_own(index, snippet_runs):
    run, expected = snippet_runs[index], SNIPPETS[index][1]
    assert run.returncode == 0, f"README snippet {snippet_id(index)} failed:\n{run.stderr[-3000:]}"
    if expected:
        assert run.stdout.strip() == expected.strip()


def synopsis() -> dict[str, str]:
    """Subcommand -> its lines in the README's command-line synopsis, comments removed."""
    block = README.split("## Command line\n\n```\n", 1)[1].split("```", 1)[0]
    lines: dict[str, str] = {}
    names: list[str] = []
    for line in block.splitlines():
        code = line.split("#", 1)[0]
        if code.startswith("hf-latentlm "):
            names = code.split()[1].split("|")  # "sft|dpo": one line for both
        for name in names:
            lines[name] = lines.get(name, "") + " " + code
    return lines


def test_synopsis_lists_every_option_of_every_subcommand():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    written = synopsis()
    assert sorted(written) == sorted(subparsers.choices), f"subcommands: {sorted(subparsers.choices)}"
    for name, parser in subparsers.choices.items():
        options = {s for action in parser._actions for s in action.option_strings if s.startswith("--")} - {"--help"}
        listed = set(re.findall(r"--[a-z][a-z0-9-]*", written[name]))
        assert listed == options, (f"hf-latentlm {name}: the README synopsis lacks {sorted(options - listed)} and "
                                   f"names {sorted(listed - options)}, which the parser does not have")
    families = re.search(r"--family \{([^}]*)\}", written["train"]).group(1).split(",")
    presets = re.search(r"--preset \{([^}]*)\}", written["train"]).group(1).split(",")
    assert sorted(families) == sorted(FAMILIES) and presets == list(PRESETS)
