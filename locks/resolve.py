"""Lock and check the role environments: one exactly pinned set of packages per role.

The roles conflict (SGLang pins transformers 5.19.0, Megatron-Bridge caps it at 5.12.1, the torch
engine needs 5.20 or newer), so each runs in its own interpreter, installed from the recipe's
pyproject extra for that role and constrained by that role's lock, locks/<role>.txt:

    pip install -c locks/<role>.txt -e '.[<extras>]'

    python locks/resolve.py lock [ROLE ...]    write the locks (keeps every pin still allowed)
    python locks/resolve.py check [ROLE ...]   resolve again and compare with the locks

Both resolve with uv for the role's target (CPython version, manylinux x86-64 platform), wheels
only except the source distributions the role names, so a machine without a GPU proves what a GPU
machine will install. `check` fails, naming the role, when the resolution fails (uv's message
names the conflicting packages) or differs from the lock: a package the lock does not pin, or a
pin that nothing needs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "locks"

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*$")


@dataclass(frozen=True)
class Role:
    """What a role installs and where: pyproject extras, CPython versions, manylinux platform."""

    name: str
    extras: tuple[str, ...]
    pythons: tuple[str, ...]
    # uv's name for the target platform: the oldest glibc the role's wheels allow.
    platform: str
    # Packages that ship only a source distribution, built on install (see docs/cluster.md).
    sdists: tuple[str, ...]
    summary: str

    @property
    def lock_path(self) -> Path:
        return LOCKS / f"{self.name}.txt"


# hydra-core's antlr4-python3-runtime 4.9.3 has no wheel; it is pure Python.
_ANTLR = "antlr4-python3-runtime"

ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        Role(
            name="cpu",
            extras=("dev",),
            pythons=("3.11", "3.12"),
            platform="x86_64-manylinux_2_28",
            sdists=(_ANTLR,),
            summary="the recipe, the torch engine and trainer, the driver; `make install`",
        ),
        Role(
            name="sglang",
            extras=("sglang",),
            pythons=("3.12",),
            # SGLang's own wheels are manylinux_2_34; 2_39 is the Megatron role's floor (one image).
            platform="x86_64-manylinux_2_39",
            sdists=(_ANTLR,),
            summary="generation: SGLang servers (torch 2.14.1, CUDA 13.0)",
        ),
        Role(
            name="megatron",
            extras=("megatron",),
            pythons=("3.12",),
            # nvidia-resiliency-ext (megatron-core's) ships manylinux_2_39 wheels only.
            platform="x86_64-manylinux_2_39",
            # wget is pure Python; transformer-engine-torch and fast-hadamard-transform compile
            # CUDA extensions against the installed torch (`--no-build-isolation`, nvcc 13.0).
            sdists=(_ANTLR, "wget", "transformer-engine-torch", "fast-hadamard-transform"),
            summary="training: Megatron-core, Bridge, Transformer Engine (torch 2.14.1, CUDA 13.0)",
        ),
    )
}


class ResolutionError(RuntimeError):
    """A role's environment does not resolve, or resolves to something else than its lock."""


def normalize(name: str) -> str:
    """The package name as PyPI compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """`name==version` lines of a requirements file by normalized name; anything else refused."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if match is None:
            raise ValueError(f"line {number}: not an exact pin `name==version`: {raw!r}")
        name = normalize(match.group(1))
        if name in pins:
            raise ValueError(f"line {number}: {name} pinned twice")
        pins[name] = match.group(2)
    return pins


def compare(role: str, python: str, locked: dict[str, str], resolved: dict[str, str]) -> list[str]:
    """Every difference between a role's lock and a resolution constrained by it, one line each
    (a pinned version cannot differ: the lock is the resolver's constraints)."""
    where = f"{role} (Python {python})"
    problems = [
        f"{where}: {name}=={version} is resolved but not pinned in locks/{role}.txt"
        for name, version in sorted(resolved.items())
        if name not in locked
    ]
    problems += [
        f"{where}: {name}=={version} is pinned in locks/{role}.txt but nothing needs it"
        for name, version in sorted(locked.items())
        if name not in resolved
    ]
    return problems


def _uv() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def _uv_env() -> dict[str, str]:
    """This environment without uv settings that could point the resolver elsewhere."""
    return {key: value for key, value in os.environ.items() if not key.startswith("UV_")}


def compile_role(role: Role, python: str, output: Path, constraints: Path | None) -> None:
    """Resolve the role's extras for its target into `output` (pins, annotated)."""
    command = [
        _uv(),
        "pip",
        "compile",
        str(ROOT / "pyproject.toml"),
        "--no-config",
        "--quiet",
        "--python-version",
        python,
        "--python-platform",
        role.platform,
        "--only-binary",
        ":all:",
        "--custom-compile-command",
        f"python locks/resolve.py lock {role.name}",
        "--output-file",
        str(output),
    ]
    for extra in role.extras:
        command += ["--extra", extra]
    for sdist in role.sdists:
        command += ["--no-binary", sdist]
    if constraints is not None:
        command += ["--constraint", str(constraints)]
    result = subprocess.run(command, capture_output=True, text=True, env=_uv_env(), check=False)
    if result.returncode != 0:
        raise ResolutionError(
            f"role {role.name} (Python {python}, {role.platform}) does not resolve:\n"
            + result.stderr.strip()
        )


def _header(role: Role) -> str:
    extras = ",".join(role.extras)
    major, minor = role.platform.removeprefix("x86_64-manylinux_").split("_")
    glibc = f"glibc >= {major}.{minor}"
    return (
        f"# Role `{role.name}`: {role.summary}.\n"
        f"# Exact pins for CPython {' and '.join(role.pythons)}, Linux x86-64, {glibc}.\n"
        f"# Install: pip install -c locks/{role.name}.txt -e '.[{extras}]'\n"
        f"# Built from source on install: {', '.join(role.sdists)}\n"
        '# (docs/cluster.md, "Role environments", says how).\n'
        "# Written by `make envs-lock`; `make envs-check` proves it resolves.\n"
    )


def lock(role: Role) -> None:
    """Write the role's lock, resolved for its first Python (existing pins are preferred)."""
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / f"{role.name}.txt"
        if role.lock_path.exists():
            output.write_text(role.lock_path.read_text())
        compile_role(role, role.pythons[0], output, constraints=None)
        text = output.read_text()
    body = text[text.index("# This file was autogenerated") :]
    role.lock_path.write_text(_header(role) + body)


def check(role: Role, lock_file: Path | None = None) -> None:
    """Resolve the role with its lock (default: locks/<role>.txt) as constraints for each of its
    Pythons; raise on a failed resolution or any difference from the lock."""
    lock_file = lock_file or role.lock_path
    locked = read_pins(lock_file.read_text())
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        for python in role.pythons:
            output = Path(folder) / f"{role.name}-{python}.txt"
            compile_role(role, python, output, constraints=lock_file)
            problems += compare(role.name, python, locked, read_pins(output.read_text()))
    if problems:
        raise ResolutionError("\n".join(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Lock or check the role environments (locks/).")
    parser.add_argument("action", choices=("lock", "check"))
    parser.add_argument("roles", nargs="*", help=f"some of {', '.join(ROLES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.roles) - set(ROLES))
    if unknown:
        parser.error(f"unknown role(s) {', '.join(unknown)}; roles: {', '.join(ROLES)}")
    failed = False
    for name in args.roles or ROLES:
        role = ROLES[name]
        start = time.monotonic()
        try:
            (lock if args.action == "lock" else check)(role)
        except ResolutionError as error:
            print(error, file=sys.stderr)
            failed = True
            continue
        print(f"{args.action} {name}: ok ({time.monotonic() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
