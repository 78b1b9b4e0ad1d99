"""Which layer of `gymrl` may import which: every module's imports (inside functions too) are
checked against one table, so the tree keeps the rooms docs/architecture.md draws.

Lower layers never import higher ones. `preflight` (validation and the dry-run plan) is the one
room allowed to look up at generation's parsers and prompt builder, the model's folders and the
trainers' capabilities, because a config must be refused (and its template proved) before
anything starts; it stays torch-free (tests/recipes/test_grpo_entry.py).
`config` is a leaf: the schema and its composition import nothing else of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gymrl

PACKAGE_DIR = Path(gymrl.__file__).parent

LOWER = {
    "config": set(),
    "run": {"config"},
    "cluster": {"config", "run"},
    "tracking": {"config", "run"},
    "model": {"config", "run"},
    "algo": {"config"},
    "generation": {"config", "run", "cluster", "model"},
    "trainer": {"config", "run", "cluster", "model", "algo", "generation"},
    "experience": {"config", "algo", "run"},
    "preflight": {"config", "cluster", "model", "generation", "trainer"},
}
LOWER["roles"] = set(LOWER) - {"roles", "preflight", "tracking"}
LOWER["recipes"] = set(LOWER) | {"roles"}
# The `python -m gymrl.<tool>` commands at the package root.
COMMANDS = {"report", "plot", "dashboard"}


def layer_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).parts
    return parts[0] if len(parts) > 1 else path.stem


def imported_layers(path: Path) -> list[tuple[int, str]]:
    """(line, layer) for every import of another `gymrl` module in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("gymrl.")]
    return found


def test_every_module_lives_in_a_known_room():
    rooms = {layer_of(path) for path in PACKAGE_DIR.rglob("*.py")} - {"__init__"}
    assert rooms == set(LOWER) | COMMANDS


def test_no_layer_imports_one_above_it():
    wrong = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        layer = layer_of(path)
        allowed = {"tracking"} if layer in COMMANDS else LOWER.get(layer, set())
        for line, target in imported_layers(path):
            if target != layer and target not in allowed:
                wrong.append(f"{path.relative_to(PACKAGE_DIR)}:{line}: {layer} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from gymrl.recipes.training import GRPORecipe\n")
    assert imported_layers(module) == [(2, "recipes")]
