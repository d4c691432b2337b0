"""The package's size as the house issues measure it: lines of Python under hf_latentlm/, the functions over 60 lines,
and the Markdown lines and non-Markdown files under docs/.

    python scripts/checks/code_size.py            # this checkout
    python scripts/checks/code_size.py --rev REV  # the same for a commit (read from git, nothing checked out)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONG = 60


def files_at(rev: str | None, folder: str) -> dict[str, str]:
    """{path: text} of every file under `folder`, in the working tree or at `rev`."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in (ROOT / folder).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, folder], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True, capture_output=True,
                                 text=True, errors="replace").stdout for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a commit to measure instead of the working tree")
    rev = parser.parse_args().rev
    package = {name: text for name, text in files_at(rev, "hf_latentlm").items() if name.endswith(".py")}
    long = []
    for name, text in package.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LONG:
                long.append((node.end_lineno - node.lineno + 1, f"{name}:{node.lineno} {node.name}"))
    docs = files_at(rev, "docs")
    print(f"hf_latentlm/: {sum(len(t.splitlines()) for t in package.values())} lines of Python in {len(package)} files")
    print(f"functions over {LONG} lines: {len(long)}")
    for length, where in sorted(long, reverse=True):
        print(f"  {length} {where}")
    markdown = [t for n, t in docs.items() if n.endswith(".md")]
    print(f"docs/: {sum(len(t.splitlines()) for t in markdown)} lines of Markdown in {len(markdown)} files, "
          f"{sum(not n.endswith('.md') for n in docs)} other files")


if __name__ == "__main__":
    main()
