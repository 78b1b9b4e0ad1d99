"""Which room of `gymrl` may import which: each package's docstring ends with the rooms it may
import (`May import: ...`; a wing of generation: `Of generation, may import: ...`), and every
module's imports (inside functions too) are checked against those lines, so the signs on the
doors, this test and docs/architecture.md's table (checked here too) cannot drift apart.

Lower rooms never import higher ones. `preflight` (validation and the dry-run plan) is the one
room allowed to look up at generation's parsers and prompt builder, the model's folders and the
trainers' capabilities, because a config must be refused (and its template proved) before
anything starts; it stays torch-free (tests/recipes/test_grpo_entry.py).
`config` is a leaf: the schema and its composition import nothing else of the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gymrl

PACKAGE_DIR = Path(gymrl.__file__).parent
ARCHITECTURE_DOC = PACKAGE_DIR.parent / "docs" / "architecture.md"
GENERATION_WINGS = ("server", "torch", "sglang")
# The `python -m gymrl.<tool>` commands at the package root.
COMMANDS = {"report", "plot", "dashboard"}


def _sign(package: Path, heading: str) -> set[str]:
    """The rooms named on `package`'s door: its docstring's line `<heading> a, b.`."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
    match = re.search(rf"^{re.escape(heading)} (.+?)\.$", doc or "", re.MULTILINE | re.DOTALL)
    assert match, f"{package.relative_to(PACKAGE_DIR.parent)}/__init__.py has no '{heading}' line"
    names = match.group(1).replace("\n", " ")
    return set() if names == "nothing" else {name.strip() for name in names.split(",")}


def rooms() -> list[str]:
    return sorted(p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").is_file())


LOWER = {room: _sign(PACKAGE_DIR / room, "May import:") for room in rooms()}
WINGS = {
    wing: _sign(PACKAGE_DIR / "generation" / wing, "Of generation, may import:")
    for wing in GENERATION_WINGS
}


def layer_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).parts
    return parts[0] if len(parts) > 1 else path.stem


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a `gymrl` module in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.startswith("gymrl.")]
    return found


def imported_layers(path: Path) -> list[tuple[int, str]]:
    """(line, room) for every import of another `gymrl` module in `path`."""
    return [(line, module.split(".")[1]) for line, module in imported_modules(path)]


def test_every_module_lives_in_a_known_room():
    found = {layer_of(path) for path in PACKAGE_DIR.rglob("*.py")} - {"__init__"}
    assert found == set(LOWER) | COMMANDS


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


def test_the_signs_are_read_from_the_doors():
    assert LOWER["config"] == set()
    assert LOWER["run"] == {"config"}
    assert "roles" in LOWER["recipes"] and "preflight" not in LOWER["roles"]
    assert {wing: {"types"} for wing in GENERATION_WINGS} == WINGS


def test_no_wing_of_generation_imports_another():
    wrong = []
    for wing, allowed in WINGS.items():
        for path in sorted((PACKAGE_DIR / "generation" / wing).rglob("*.py")):
            for line, module in imported_modules(path):
                parts = module.split(".")
                if parts[:2] != ["gymrl", "generation"] or parts[2] == wing:
                    continue
                if parts[2] not in allowed:
                    wrong.append(f"{path.relative_to(PACKAGE_DIR)}:{line}: {wing} imports {module}")
    assert not wrong, "imports between generation's wings:\n" + "\n".join(wrong)


def test_architecture_doc_draws_the_same_table():
    """docs/architecture.md's table of rooms (`| \\`room/\\` | ... | may import |`) says what
    the doors say."""
    drawn = {}
    for row in re.findall(r"^\| `(\w+)/` \|.*\| (.+) \|$", ARCHITECTURE_DOC.read_text(), re.M):
        room, names = row
        drawn[room] = set() if names == "nothing" else {n.strip() for n in names.split(",")}
    assert drawn == LOWER
