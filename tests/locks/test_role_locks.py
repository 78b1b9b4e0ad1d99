"""The role environments (locks/<role>.txt): exact, mutually consistent pins per role.

Offline tests read the locks and pyproject.toml. Tests marked `registry` resolve each role again
against the package registry for its GPU platform (locks/resolve.py, uv), which needs the network:
CI runs them (`python -m pytest -m registry`, about 70 s with the conflict case).
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _load_resolve():
    spec = importlib.util.spec_from_file_location("locks_resolve", ROOT / "locks" / "resolve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


resolve = _load_resolve()
ROLES = sorted(resolve.ROLES)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins(role: str) -> dict[str, str]:
    return resolve.read_pins(resolve.ROLES[role].lock_path.read_text())


@pytest.mark.parametrize("role", ROLES)
def test_every_lock_line_is_an_exact_pin(role):
    assert len(_pins(role)) > 50


@pytest.mark.parametrize("role", ROLES)
def test_the_extras_exact_pins_are_the_locks(role):
    """What pyproject pins for a role (sglang==0.5.23, torch==2.14.1, ...) is what its lock pins."""
    pins = _pins(role)
    extras = PYPROJECT["project"]["optional-dependencies"]
    lines = [line for extra in resolve.ROLES[role].extras for line in extras[extra]]
    requirements = [Requirement(line) for line in [*lines, *PYPROJECT["project"]["dependencies"]]]
    for requirement in requirements:
        name = resolve.normalize(requirement.name)
        assert name in pins, f"{role}: {name} is required but not locked"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{role}: locks/{role}.txt pins {name}=={pins[name]}, pyproject wants {requirement}"
        )


def test_one_ray_version_across_the_roles():
    """One Ray cluster spans every role's interpreter, and Ray refuses mixed versions."""
    versions = {role: _pins(role)["ray"] for role in ROLES}
    assert len(set(versions.values())) == 1, versions


@pytest.mark.parametrize("role", ROLES)
def test_every_allowed_source_distribution_is_in_the_lock(role):
    """A source build allowed by name is one the role really installs (no stale exception)."""
    pins = _pins(role)
    assert [name for name in resolve.ROLES[role].sdists if name not in pins] == []


def test_read_pins_refuses_ranges_and_duplicates():
    assert resolve.read_pins("Foo_Bar==1.0  # why\n# comment\n\nbaz==2\n") == {
        "foo-bar": "1.0",
        "baz": "2",
    }
    with pytest.raises(ValueError, match=r"line 1: not an exact pin"):
        resolve.read_pins("torch>=2.13\n")
    with pytest.raises(ValueError, match=r"line 2: foo-bar pinned twice"):
        resolve.read_pins("foo-bar==1\nfoo_bar==1\n")


def test_compare_names_every_gap_between_lock_and_resolution():
    problems = resolve.compare("sglang", "3.12", {"a": "1", "stale": "2"}, {"a": "1", "new": "4"})
    assert problems == [
        "sglang (Python 3.12): new==4 is resolved but not pinned in locks/sglang.txt",
        "sglang (Python 3.12): stale==2 is pinned in locks/sglang.txt but nothing needs it",
    ]


@pytest.mark.registry
@pytest.mark.parametrize("role", ROLES)
def test_the_lock_resolves_for_the_roles_platform(role):
    resolve.check(resolve.ROLES[role])


@pytest.mark.registry
def test_a_conflicting_lock_fails_naming_the_role_and_the_packages(tmp_path):
    """SGLang's lock with the Megatron role's transformers and tokenizers: uv names SGLang's pin."""
    role = resolve.ROLES["sglang"]
    text = role.lock_path.read_text()
    sglang, megatron = _pins("sglang"), _pins("megatron")
    for name in ("transformers", "tokenizers"):
        pinned = f"{name}=={sglang[name]}\n"
        assert pinned in text
        text = text.replace(pinned, f"{name}=={megatron[name]}\n")
    lock_file = tmp_path / "sglang.txt"
    lock_file.write_text(text)
    with pytest.raises(resolve.ResolutionError) as failure:
        resolve.check(role, lock_file)
    first, uv_says = str(failure.value).split("\n", 1)
    assert first == "role sglang (Python 3.12, x86_64-manylinux_2_39) does not resolve:"
    assert f"depends on transformers=={sglang['transformers']}" in uv_says
    assert f"transformers=={megatron['transformers']}" in uv_says
