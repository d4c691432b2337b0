"""Repository contracts: CI runs the README's test command verbatim; the modeling folder stays
flat and importable by a Hub checkpoint (siblings and torch/transformers only)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quickstart, flags=re.S)


def test_quickstart_has_two_commands_and_ci_runs_the_test_one_verbatim():
    commands = readme_commands()
    assert len(commands) == 2
    assert "hf-latentlm train" in commands[0] and "pytest" in commands[1]
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith("#")]
    assert commands[1] in ci_lines


def test_modeling_files_import_only_siblings_torch_and_transformers():
    folder = ROOT / "hf_latentlm" / "modeling"
    assert not [p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"], "modeling/ must stay flat"
    for path in folder.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module and "." not in node.module, f"{path.name}: {ast.dump(node)}"
                assert (folder / f"{node.module}.py").is_file(), f"{path.name} imports missing sibling {node.module}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    root = name.split(".")[0]
                    assert root in {"torch", "transformers", "math", "copy", "dataclasses", "typing", "__future__"}, \
                        f"{path.name} imports {name}"
