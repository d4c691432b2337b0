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


def test_readme_stays_a_front_door():
    """At most 200 lines; family detail lives in docs/families/, measurements in results/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


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
                    # (standard-library modules every Python has, and huggingface_hub, which transformers requires
                    # and whose `strict` its configs use: remote code still needs nothing else)
                    assert root in {"torch", "transformers", "huggingface_hub", "math", "copy", "contextlib",
                                    "dataclasses", "functools", "typing", "warnings", "__future__"}, \
                        f"{path.name} imports {name}"


#: The package's layers, bottom first (docs/architecture.md). A module imports only from layers below its own, or
#: from its own folder (training -> training); every import counts, function-local ones included.
LAYERS = [("hf_latentlm.folders", "hf_latentlm.presets", "hf_latentlm.cards", "hf_latentlm.data"), ("hf_latentlm.modeling",),
          ("hf_latentlm.families",), ("hf_latentlm.loading",), ("hf_latentlm.training",), ("hf_latentlm.eval",),
          ("hf_latentlm.hub", "hf_latentlm.recipes", "hf_latentlm.serving"), ("hf_latentlm.official",),
          ("hf_latentlm.cli",)]


def package_modules() -> dict[str, Path]:
    files = sorted((ROOT / "hf_latentlm").rglob("*.py"))
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(module: str) -> tuple[int, str]:
    for index, group in enumerate(LAYERS):
        for prefix in group:
            if module == prefix or module.startswith(prefix + "."):
                return index, prefix
    raise AssertionError(f"{module} belongs to no layer of LAYERS")


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def test_layers_import_only_downwards():
    for module, imports in import_graph().items():
        if module == "hf_latentlm":
            continue
        level, group = layer_of(module)
        for target in imports:
            if target == "hf_latentlm":
                continue
            target_level, target_group = layer_of(target)
            # modules of one folder (modeling/, training/, eval/, data/) may import each other; the single modules of a
            # layer (folders, presets, cards; hub, recipes) may not
            same_folder = target_group == group and (ROOT / group.replace(".", "/")).is_dir()
            assert target_level < level or same_folder, f"{module} (layer {level}) imports {target} ({target_level})"


def test_no_import_circles_including_the_registrys_lazy_fields():
    """No module reaches itself through imports; the registry's "module:attribute" fields (imported on read) point
    at modules that never import the registry back."""
    from hf_latentlm import families

    graph = import_graph()

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph.get(module, ())
        return seen

    for module in graph:
        assert module not in reach(module), f"{module} imports itself through a circle"
    for spec in families.FAMILIES.values():
        for field in ("config_class", "model_class", "training_report", "response_scorer", "model_card"):
            value = spec.__dict__.get(f"_{field}")  # a "module:attribute" string until first read
            if value is None:
                continue
            target = value.partition(":")[0] if isinstance(value, str) else \
                getattr(value, "__module__", None) or type(value).__module__
            if target.startswith("hf_latentlm."):
                assert target in graph and "hf_latentlm.families" not in reach(target) | {target}, \
                    f"{spec.name}.{field} = {value!r} imports the registry back"


def test_the_bad_inputs_table_quotes_messages_its_tests_assert():
    """docs/bad_inputs.md stays true: each row's message is asserted in the test file the row names (compared with
    regex escapes removed, as `pytest.raises(match=...)` writes some of them), and no row is left without one."""
    rows = [line for line in (ROOT / "docs" / "bad_inputs.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| command") and not line.startswith("|---")]
    assert len(rows) >= 50
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 5, row
        message, test_file = cells[3].strip("`"), ROOT / cells[4]
        assert test_file.is_file(), row
        assert message in test_file.read_text().replace("\\", ""), f"{cells[4]} asserts no {message!r}"
