"""Finds blocking calls without a deadline in Python source, by reading it (no import).

Used by tests/test_waits_have_deadlines.py over the package's sources. A wait without a deadline
is how a run stalls until walltime on a cluster that sits idle; the project's rule is that every
wait has one. The checker knows the blocking calls by their shape, since it cannot know types:

* `ray.get` / `ray.wait` (also through an attribute ending in `ray`, like `self._ray`) without
  `timeout=`;
* zero-argument `.get()`, `.wait()`, `.join()`, `.result()`, `.acquire()`, `.communicate()`
  (a queue, an event or condition, a thread or process, a future, a lock, a child process):
  each takes a timeout, and one without it waits forever; `asyncio.wait` and
  `concurrent.futures.wait` without `timeout=`;
* `httpx.Client`, `httpx.AsyncClient` and module-level `httpx` requests without an explicit
  `timeout=` (httpx's own default is easy to lose in a refactor, so it must be written down);
* `subprocess.run`, `call`, `check_call`, `check_output` without `timeout=`;
* `torch.distributed` collectives: bounded only by their process group's timeout, so every
  process group the source creates (`init_process_group`, `new_group`) must pass `timeout=`;
* any call that passes `timeout=None` or `timeout_s=None` explicitly.

An awaited call inside `asyncio.wait_for(...)`, or inside an `async with asyncio.timeout(...)`
block, is bounded by it. Everything else that matches is either fixed or listed, with the reason
it is bounded another way, in the caller's allow-list.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ZERO_ARGUMENT_WAITS = {"get", "wait", "join", "result", "acquire", "communicate"}
# Receivers whose zero-argument `.get()` is a lookup, not a wait.
LOOKUPS = {"HydraConfig"}
HTTPX_CALLS = {
    "Client",
    "AsyncClient",
    "get",
    "post",
    "put",
    "patch",
    "delete",
    "request",
    "stream",
}
SUBPROCESS_WAITS = {"run", "call", "check_call", "check_output"}
COLLECTIVES = {
    "barrier",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "send",
    "recv",
    "monitored_barrier",
}
GROUP_CREATORS = {"init_process_group", "new_group"}
DISTRIBUTED = {"dist", "torch.distributed"}


@dataclass(frozen=True)
class Wait:
    """One blocking call without a deadline: where (file relative to the root, the enclosing
    function's dotted name, the line) and what (the call's source, and why it is a finding)."""

    path: str
    function: str
    line: int
    call: str
    why: str

    @property
    def key(self) -> tuple[str, str, str]:
        """How an allow-list names it: (path, function, the call's callee) survives edits that
        move lines."""
        return self.path, self.function, self.call.split("(", 1)[0]


def unbounded_waits(root: Path, folders: list[str]) -> list[Wait]:
    """Every finding in the `.py` files under `folders` of `root`."""
    found: list[Wait] = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            found += unbounded_waits_in(path.read_text(), path.relative_to(root).as_posix())
    return found


def unbounded_waits_in(source: str, path: str) -> list[Wait]:
    """The findings in one module's `source` (`path` names it in each finding)."""
    visitor = _Visitor(path)
    visitor.visit(ast.parse(source))
    return visitor.found


def collectives_and_groups(root: Path, folders: list[str]) -> tuple[list[str], list[str]]:
    """`torch.distributed` collectives called, and process groups created without `timeout=`
    (as `path:line call`): collectives are bounded only if the second list is empty."""
    collectives, untimed = [], []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                receiver = ast.unparse(node.func.value)
                if receiver not in DISTRIBUTED:
                    continue
                if node.func.attr in COLLECTIVES:
                    collectives.append(f"{where}:{node.lineno} {ast.unparse(node)}")
                if node.func.attr in GROUP_CREATORS and not _has_keyword(node, "timeout"):
                    untimed.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return collectives, untimed


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path = path
        self.found: list[Wait] = []
        self._scope: list[str] = []
        self._bounded = 0  # depth of enclosing asyncio.wait_for calls / asyncio.timeout blocks
        self._imported_waits: set[str] = set()  # `wait` imported from concurrent.futures/asyncio

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in {"concurrent.futures", "asyncio"}:
            self._imported_waits |= {a.asname or a.name for a in node.names if a.name == "wait"}

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_AsyncWith(self, node: ast.AsyncWith) -> None:
        timed = any(_callee(item.context_expr) == "asyncio.timeout" for item in node.items)
        self._bounded += timed
        self.generic_visit(node)
        self._bounded -= timed

    def visit_Call(self, node: ast.Call) -> None:
        bounds = _callee(node) == "asyncio.wait_for"
        if not self._bounded:
            why = _why_unbounded(node, self._imported_waits)
            if why is not None:
                self.found.append(
                    Wait(
                        self.path,
                        ".".join(self._scope) or "<module>",
                        node.lineno,
                        ast.unparse(node),
                        why,
                    )
                )
        self._bounded += bounds
        self.generic_visit(node)
        self._bounded -= bounds


def _callee(node: ast.expr) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def _has_keyword(node: ast.Call, name: str) -> bool:
    return any(keyword.arg == name for keyword in node.keywords)


def _none_keyword(node: ast.Call) -> str | None:
    for keyword in node.keywords:
        if keyword.arg in {"timeout", "timeout_s"}:
            value = keyword.value
            if isinstance(value, ast.Constant) and value.value is None:
                return keyword.arg
    return None


def _why_unbounded(node: ast.Call, imported_waits: set[str]) -> str | None:
    none = _none_keyword(node)
    if none is not None:
        return f"passes {none}=None"
    func = node.func
    if isinstance(func, ast.Name):
        if func.id in imported_waits and not _has_keyword(node, "timeout"):
            return "futures wait without timeout="
        return None
    if not isinstance(func, ast.Attribute):
        return None
    receiver, name = ast.unparse(func.value), func.attr
    timed = _has_keyword(node, "timeout")
    if receiver == "ray" or receiver.endswith("_ray") or receiver.endswith(".ray"):
        if name in {"get", "wait"} and not timed:
            return f"ray.{name} without timeout="
        return None
    if receiver == "httpx":
        if name in HTTPX_CALLS and not timed:
            return f"httpx.{name} without an explicit timeout="
        return None
    if receiver == "subprocess":
        if name in SUBPROCESS_WAITS and not timed:
            return f"subprocess.{name} without timeout="
        return None
    if receiver == "asyncio" and name == "wait" and not timed:
        return "asyncio.wait without timeout="
    if name in ZERO_ARGUMENT_WAITS and not node.args and not node.keywords:
        if name == "get" and receiver in LOOKUPS:
            return None
        return f".{name}() waits without a deadline"
    return None


def describe(waits: list[Wait]) -> Iterator[str]:
    for wait in waits:
        yield f"{wait.path}:{wait.line} in {wait.function}: {wait.call}  ({wait.why})"
