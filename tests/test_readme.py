"""The README and the documentation pages it sends a new user to, as that user reads them.

The documents are README.md, docs/guide.md and every docs/families/*.md. Every ```python block of them runs verbatim
in a fresh interpreter, from one folder holding what their own `hf-latentlm train` commands write (run at the `tiny`
preset for one step instead of their full length); a block followed by a ```text block must print exactly that.
Every `hf-latentlm train` command in them parses. The README's command-line synopsis names exactly the parser's
options, and every language-model family has its page under docs/families/.
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

ROOT = Path(__file__).resolve().parents[1]
FAMILY_PAGES = ROOT / "docs" / "families"
# document (path from the repository root) -> its text
DOCUMENTS = {path.relative_to(ROOT).as_posix(): path.read_text()
             for path in [ROOT / "README.md", ROOT / "docs" / "guide.md", *sorted(FAMILY_PAGES.glob("*.md"))]}
README = DOCUMENTS["README.md"]
PYTHON_BLOCK = r"```python\n(.*?)```(?:\n\n```text\n(.*?)```)?"
# (document, code, the printed output the document shows right after it, or "")
SNIPPETS = [(document, code, expected) for document, text in DOCUMENTS.items()
            for code, expected in re.findall(PYTHON_BLOCK, text, flags=re.S)]


def snippet_id(index: int) -> str:
    """The document and section a snippet sits in, for the test id."""
    document, code, _ = SNIPPETS[index]
    text = DOCUMENTS[document]
    before = text[:text.index(code)]
    section = before.rsplit("\n## ", 1)[-1].split("\n", 1)[0] if "\n## " in before else ""
    name = Path(document).stem.lower()
    return f"{index}-{name}-{section.split(' (')[0].lower().replace(' ', '-')}".rstrip("-")


def train_commands() -> dict[str, argparse.Namespace]:
    """--output-dir -> parsed arguments of every `hf-latentlm train ... --output-dir DIR` in a ```bash block or an
    inline code span of the documents, parsed by the real parser (an option that does not exist fails here). Two
    commands that write the same folder must agree on the family, its components and its config."""
    commands, where = {}, {}
    for document, text in DOCUMENTS.items():
        text = text.replace("\\\n", " ")  # shell line continuations
        bash = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        pieces = [line for block in bash for line in block.splitlines()]
        pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
        for piece in pieces:
            for match in re.finditer(r"hf-latentlm (train\b[^&;|]*)", piece):
                if "--output-dir" not in match.group(1):
                    continue  # a mention of the command, not a command
                try:
                    args = build_parser().parse_args(shlex.split(match.group(1)))
                except SystemExit:
                    pytest.fail(f"the {document} command `hf-latentlm {match.group(1).strip()}` does not parse")
                made = (args.family, {name: getattr(args, name) for name in component_names()}, args.config)
                if args.output_dir in where and where[args.output_dir][1] != made:
                    pytest.fail(f"{document} and {where[args.output_dir][0]} train different models into "
                                f"{args.output_dir!r}")
                where[args.output_dir] = (document, made)
                commands[args.output_dir] = args
    return commands


class ReadmeFolders:
    """Writes, under `root`, the folder a documented command makes, after the folders it needs (its components)."""

    def __init__(self, root: Path, rows):
        self.root, self.rows, self.commands, self.made = root, rows, train_commands(), set()

    def make(self, folder: str) -> None:
        from hf_latentlm.training.loop import TrainConfig, train

        if folder in self.made:
            return
        if folder not in self.commands:
            pytest.fail(f"a snippet loads {folder!r}, which no `hf-latentlm train` command of {sorted(DOCUMENTS)} "
                        f"writes (known: {sorted(self.commands)})")
        if Path(folder).is_absolute():
            pytest.fail(f"a snippet loads the absolute folder {folder!r}: use a folder relative to where the "
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
    for _, code, _ in SNIPPETS:
        saved = set(re.findall(r"save_pretrained\(\s*\"([^\"]+)\"", code))
        for folder in sorted(set(re.findall(r"from_pretrained\(\s*\"([^\"]+)\"", code)) - saved):
            folders.make(folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=folders.root, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=600)  # stdin closed: an interactive prompt fails

    # Each interpreter spends seconds importing torch and transformers: overlap them.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(run, [code for _, code, _ in SNIPPETS]))


def test_every_python_block_is_collected():
    for document, text in DOCUMENTS.items():
        assert sum(1 for d, _, _ in SNIPPETS if d == document) == text.count("```python"), document
    assert len(SNIPPETS) >= 8


def test_every_documented_train_command_parses():
    assert len(train_commands()) >= 8


def test_every_language_model_family_has_its_page():
    missing = [name for name, spec in FAMILIES.items() if spec.language_model
               and not (FAMILY_PAGES / f"{name}.md").is_file()]
    assert not missing, f"no docs/families/<family>.md for {missing}"


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=snippet_id)
def test_documented_snippet_runs_on_its_own(index, snippet_runs):
    run, expected = snippet_runs[index], SNIPPETS[index][2]
    assert run.returncode == 0, f"snippet {snippet_id(index)} failed:\n{run.stderr[-3000:]}"
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
        # An option may have several spellings (--output-dir, --output_dir; --train-file, --train-files): the
        # synopsis names one of each option's dashed spellings, and nothing the parser does not have.
        # A command with its own subcommands (convert calm|cola): the options of each.
        nested = [p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]
        spellings = [{s for s in action.option_strings if s.startswith("--") and "_" not in s}
                     for each in [parser, *nested] for action in each._actions
                     if action.option_strings and action.dest != "help"]
        listed = set(re.findall(r"--[a-z][a-z0-9-]*", written[name]))
        lacking = sorted(min(names) for names in spellings if not names & listed)
        unknown = sorted(listed - set().union(*spellings))
        assert not lacking and not unknown, (f"hf-latentlm {name}: the README synopsis lacks {lacking} and names "
                                             f"{unknown}, which the parser does not have")
    families = re.search(r"--family \{([^}]*)\}", written["train"]).group(1).split(",")
    presets = re.search(r"--preset \{([^}]*)\}", written["train"]).group(1).split(",")
    assert sorted(families) == sorted(FAMILIES) and presets == list(PRESETS)


def test_the_lora_snippet_never_asks_the_hub(tmp_path, monkeypatch, tokenizer, capsys):
    """The guide's LoRA snippet, run in this process with the Hub reachable in principle (offline mode off, an
    endpoint where nothing listens): no lookup fails, so it made none. An adapter folder without the tokenizer
    makes PEFT's reload ask the Hub for `tokenizer_config.json` ("Unable to fetch remote file ...")."""
    import warnings

    from huggingface_hub import constants, hf_api

    from hf_latentlm.families import build_model
    from hf_latentlm.training.checkpoint import save_tokenizer

    code = next(code for document, code, _ in SNIPPETS if document == "docs/guide.md" and "get_peft_model" in code)
    monkeypatch.chdir(tmp_path)
    build_model("plm", "tiny", tokenizer).save_pretrained("runs/plm-tiny")
    save_tokenizer(tokenizer, "runs/plm-tiny")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # (PEFT reads the variable itself)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hf_api.api, "endpoint", "http://127.0.0.1:9")  # the instance `file_exists` & co. use
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, "docs/guide.md", "exec"), {"__name__": "__snippet__"})
    failed = [str(w.message) for w in caught if "remote file" in str(w.message) or "Connection" in str(w.message)]
    assert not failed, failed
    assert "PLMForCausalLM" in capsys.readouterr().out  # the snippet ran to its end
