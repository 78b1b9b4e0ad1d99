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
* any call that passes `timeout=None` or `timeout_s=None` explicitly;
* a sleep loop: a `while` loop that sleeps (`time.sleep`, `asyncio.sleep`) and compares no
  deadline, in its test or its body, that is no comparison involving a clock
  (`time.monotonic()`, `time.time()`, `loop.time()`, ...) or a name containing `deadline`: it
  polls until something happens, and nothing says when to give up;
* `loop.run_in_executor(...)`, `asyncio.to_thread(...)` and `asyncio.gather(...)` awaited
  directly: the await lasts as long as the slowest thread or awaitable;
* `ray.init` and `ray.shutdown`, called or passed on to be called: no argument of theirs is a
  deadline (Ray bounds them, if at all, by its own constants), so each use must say what bounds
  it;
* executor exits: `with ThreadPoolExecutor(...)` (or `ProcessPoolExecutor`), whose exit waits
  for every future, and `.shutdown()` / `.shutdown(wait=True)`.

Names are resolved through the module's imports first, so `from time import sleep as nap`,
`import ray as r` and `from ray import get` are seen as `time.sleep`, `ray` and `ray.get`.

A call inside `asyncio.wait_for(...)`, or inside an `async with asyncio.timeout(...)` block, is
bounded by it. Everything else that matches is either fixed or listed, with the reason it is
bounded another way, in the caller's allow-list.
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
SLEEPS = {"time.sleep", "asyncio.sleep"}
CLOCKS = {"time.monotonic", "time.monotonic_ns", "time.time", "time.time_ns", "time.perf_counter"}
# Awaited directly, these last as long as the slowest thread or awaitable they run.
AWAITED_WAITS = {"asyncio.to_thread", "asyncio.gather"}
RAY_LIFECYCLE = {"ray.init", "ray.shutdown"}
EXECUTORS = {"ThreadPoolExecutor", "ProcessPoolExecutor"}


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
    tree = ast.parse(source)
    visitor = _Visitor(path, _imported_names(tree), tree)
    visitor.visit(tree)
    return sorted(visitor.found, key=lambda wait: wait.line)


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """What each name an import binds stands for, dotted: `nap` -> `time.sleep` for
    `from time import sleep as nap`, `r` -> `ray` for `import ray as r`. Anywhere in the module:
    an import inside a function binds the same names as one at its top, for this purpose."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".", 1)[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


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
    def __init__(self, path: str, names: dict[str, str], tree: ast.Module):
        self.path = path
        self.found: list[Wait] = []
        self._names = names
        self._scope: list[str] = []
        self._bounded = 0  # depth of enclosing asyncio.wait_for calls / asyncio.timeout blocks
        self._awaited = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Await)}
        self._called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}

    def _canonical(self, expr: ast.expr) -> str:
        """`expr` with its first name resolved through the module's imports."""
        text = ast.unparse(expr)
        head, dot, rest = text.partition(".")
        return self._names[head] + dot + rest if head in self._names else text

    def _report(self, node: ast.expr, call: str, why: str) -> None:
        function = ".".join(self._scope) or "<module>"
        self.found.append(Wait(self.path, function, node.lineno, call, why))

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_AsyncWith(self, node: ast.AsyncWith) -> None:
        timed = any(
            isinstance(item.context_expr, ast.Call)
            and self._canonical(item.context_expr.func) == "asyncio.timeout"
            for item in node.items
        )
        self._executor_exits(node)
        self._bounded += timed
        self.generic_visit(node)
        self._bounded -= timed

    def visit_With(self, node: ast.With) -> None:
        self._executor_exits(node)
        self.generic_visit(node)

    def _executor_exits(self, node: ast.With | ast.AsyncWith) -> None:
        if self._bounded:
            return
        for item in node.items:
            made = item.context_expr
            if (
                isinstance(made, ast.Call)
                and self._canonical(made.func).split(".")[-1] in EXECUTORS
            ):
                self._report(
                    made,
                    ast.unparse(made),
                    "the executor's exit waits for every future (shutdown(wait=True))",
                )

    def visit_While(self, node: ast.While) -> None:
        if not self._bounded:
            sleeps = [
                call
                for call in _own_nodes(node)
                if isinstance(call, ast.Call) and self._canonical(call.func) in SLEEPS
            ]
            if sleeps and not any(self._compares_a_deadline(n) for n in _own_nodes(node)):
                self._report(
                    sleeps[0],
                    ast.unparse(sleeps[0]),
                    f"sleeps in a while loop (line {node.lineno}) that compares no deadline",
                )
        self.generic_visit(node)

    def _compares_a_deadline(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Compare):
            return False
        for part in ast.walk(node):
            if isinstance(part, ast.Call) and (
                self._canonical(part.func) in CLOCKS
                or (ast.unparse(part.func).endswith("loop.time") and not part.args)
            ):
                return True
            if isinstance(part, ast.Name | ast.Attribute) and "deadline" in ast.unparse(part):
                return True
        return False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._lifecycle_reference(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self._lifecycle_reference(node)

    def _lifecycle_reference(self, node: ast.Attribute | ast.Name) -> None:
        """`ray.shutdown` handed on (a cleanup callback) waits when it is called later."""
        if self._bounded or id(node) in self._called:
            return
        callee = self._canonical(node)
        if callee in RAY_LIFECYCLE:
            self._report(node, ast.unparse(node), f"{callee} passed on: {_LIFECYCLE_WHY}")

    def visit_Call(self, node: ast.Call) -> None:
        callee = self._canonical(node.func)
        if not self._bounded:
            why = self._why_unbounded(node, callee)
            if why is not None:
                self._report(node, ast.unparse(node), why)
        bounds = callee == "asyncio.wait_for"
        self._bounded += bounds
        self.generic_visit(node)
        self._bounded -= bounds

    def _why_unbounded(self, node: ast.Call, callee: str) -> str | None:
        none = _none_keyword(node)
        if none is not None:
            return f"passes {none}=None"
        receiver, _, name = callee.rpartition(".")
        timed = _has_keyword(node, "timeout")
        if callee in {"asyncio.wait", "concurrent.futures.wait"}:
            return None if timed else f"{callee} without timeout="
        if callee in RAY_LIFECYCLE:
            return f"{callee}: {_LIFECYCLE_WHY}"
        if id(node) in self._awaited and (callee in AWAITED_WAITS or name == "run_in_executor"):
            return f"{name} awaited without asyncio.wait_for"
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
        if not receiver:
            return None  # a plain function: none of the methods below
        if name == "shutdown":  # an executor's waits for its futures unless told not to
            if _keyword_is(node, "wait", True) or not (node.args or node.keywords):
                return ".shutdown() waits for what runs (wait=True)"
            return None
        if name in ZERO_ARGUMENT_WAITS and not node.args and not node.keywords:
            if name == "get" and receiver.rpartition(".")[2] in LOOKUPS:
                return None
            return f".{name}() waits without a deadline"
        return None


_LIFECYCLE_WHY = "no argument is a deadline; Ray bounds it, if at all, by its own constants"


def _own_nodes(loop: ast.While) -> Iterator[ast.AST]:
    """The nodes of `loop` (its test, body and else) outside functions defined in it, which
    run when they are called, not as part of the loop."""
    pending: list[ast.AST] = [loop.test, *loop.body, *loop.orelse]
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            pending.extend(ast.iter_child_nodes(node))


def _has_keyword(node: ast.Call, name: str) -> bool:
    return any(keyword.arg == name for keyword in node.keywords)


def _keyword_is(node: ast.Call, name: str, value: object) -> bool:
    return any(
        keyword.arg == name
        and isinstance(keyword.value, ast.Constant)
        and keyword.value.value is value
        for keyword in node.keywords
    )


def _none_keyword(node: ast.Call) -> str | None:
    for keyword in node.keywords:
        if keyword.arg in {"timeout", "timeout_s"}:
            value = keyword.value
            if isinstance(value, ast.Constant) and value.value is None:
                return keyword.arg
    return None


def describe(waits: list[Wait]) -> Iterator[str]:
    for wait in waits:
        yield f"{wait.path}:{wait.line} in {wait.function}: {wait.call}  ({wait.why})"
