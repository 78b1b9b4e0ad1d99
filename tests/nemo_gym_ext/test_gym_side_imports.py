"""One import direction: `gymrl` may import `nemo_gym_ext`; `nemo_gym_ext` never imports `gymrl`.

The Gym side (wire format, postprocessor, environments) must stay usable without the trainer,
and a cycle between the two packages would make either one's import order fragile. Two checks:
the source of every module (imports inside functions included), and a real import of every
module in a fresh interpreter where `gymrl` cannot be imported at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import nemo_gym_ext

PACKAGE_DIR = Path(nemo_gym_ext.__file__).parent
FORBIDDEN = "gymrl"


def forbidden_imports(source: str, filename: str) -> list[str]:
    """`file:line: statement` for every import of `gymrl` (or a submodule) anywhere in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name == FORBIDDEN or name.startswith(f"{FORBIDDEN}.") for name in names):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_finds_imports_at_every_depth():
    source = textwrap.dedent(
        """
        import gymrl
        from gymrl.generation import types
        import gymrl_other, os
        from . import gymrl as relative
        def f():
            import gymrl.recipes.training as train
            class C:
                def g(self):
                    from gymrl import data
        """
    )
    assert [line.split(": ", 1)[0] for line in forbidden_imports(source, "x.py")] == [
        "x.py:2",
        "x.py:3",
        "x.py:7",
        "x.py:10",
    ]


def test_no_nemo_gym_ext_module_imports_gymrl():
    modules = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(modules) > 10, f"found only {len(modules)} modules under {PACKAGE_DIR}"
    found = [
        hit
        for path in modules
        for hit in forbidden_imports(path.read_text(encoding="utf-8"), str(path))
    ]
    assert not found, "nemo_gym_ext must not import gymrl:\n" + "\n".join(found)


IMPORT_ALL_WITHOUT_GYMRL = """
import importlib, pkgutil, sys
sys.modules["gymrl"] = None  # any `import gymrl...` now raises ImportError
try:
    import gymrl.generation.types
except ImportError:
    pass
else:
    raise SystemExit("blocking gymrl did not work")
import nemo_gym_ext
names = [m.name for m in pkgutil.walk_packages(nemo_gym_ext.__path__, "nemo_gym_ext.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_every_nemo_gym_ext_module_imports_without_gymrl():
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL_WITHOUT_GYMRL],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip()) > 10
