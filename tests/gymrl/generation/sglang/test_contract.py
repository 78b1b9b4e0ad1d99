"""The SGLang HTTP contract, read from the pinned wheel's own source.

The SGLang client and the stand-in the CPU tests run against (`tests/support/sglang_standin/`)
were written from the project's reading of SGLang, so they agree with each other whatever SGLang
does. This test downloads `sglang==<pin>` (the pin of pyproject.toml) without dependencies, never
installs or imports it, and parses with `ast`:

* the route table of `sglang/srt/entrypoints/http_server.py` (path, methods, the request type
  each handler takes),
* the request types of `sglang/srt/managers/io_struct.py` (dataclasses and msgspec structs:
  every field, its type, and which have no default), and the wire types of the weight checker's
  answer (`ChecksumInfo`, `ParallelismInfo`),
* the keys each handler the client reads puts in its answer, and the keys of `/generate`'s
  `meta_info` (`managers/tokenizer_manager.py`) and finish reasons (`managers/schedule_batch.py`),
* `sglang/api/v1/api_types.py`'s `SamplingParams`, the schema `/generate` checks its
  `sampling_params` against (unknown keys rejected),
* the server's arguments (`sglang/srt/arg_groups/fields/*.py`, one `--flag-name` per field, its
  type and choices), which every flag the launcher can pass must name, with a value they take,
* what the server does with the client's weight calls: the scheduler's updater
  (`managers/scheduler_components/weight_updater.py`), the model runner's
  (`model_executor/model_runner_components/weight_updater.py`, its flattened-bucket receive) and
  the weights checker's actions and mismatch message (`utils/weight_checker.py`).

It then runs the project's client through every call it makes (generation, a disk refit checked
by the weights checker's snapshot, reset and compare, a broadcast refit with the read-back check
and the checksums) against two stand-ins, which record each request, and fails on a route the
wheel lacks, a field its request type does not declare or declares with another type, or a
required field left out; every route string in the client's modules must be in the wheel and in
that run, and every answer key they read must be one the wheel makes (`sglang_answers.py`). The
stand-in's routes and request models (fields and types) are checked against the same table, its
weight-checker answers against the wheel's keys and wire types. When the pin moves, the failures
list what changed. The download needs the network: marked `registry`, as CI runs (`.ci/run`);
the wheel is cached under ~/.cache/gym-grpo-recipes/sglang-wheel/.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import types
import typing
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import save_file

from gymrl.config.schema.generation import SGLangGenerationConfig, SGLangLaunchConfig
from gymrl.config.schema.grpo import GRPOConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.config.schema.trainer import LoraConfig
from gymrl.generation.sglang.adapters import AdapterServing
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.sglang.refit_checks.read_back import ReadBackCheck
from gymrl.generation.sglang.refit_checks.weights_checker import (
    MISMATCH_PREFIX,
    ROUTE,
    WeightsChecker,
)
from gymrl.generation.sglang.servers import server_command
from gymrl.generation.sglang.weight_sync import FLATTENED_BUCKET, LIVENESS_ROUTE, WeightSender
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.run.adapter import AdapterWeights
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.real_sglang import cpu_generation
from tests.support.sglang_answers import CLIENT_READS
from tests.support.sglang_standin import make_standin

pytestmark = pytest.mark.registry

ROOT = Path(__file__).resolve().parents[4]
CACHE = Path("~/.cache/gym-grpo-recipes/sglang-wheel").expanduser()
CLIENT_FOLDER = ROOT / "gymrl" / "generation" / "sglang"
CLIENT_MODULES = (
    "engine.py",
    "servers.py",
    "weight_sync.py",
    "refit_checks/read_back.py",
    "refit_checks/weights_checker.py",
)
# Fields every io_struct request inherits for SGLang's own IPC; a client never sends them.
_IPC_FIELDS = {"rid", "http_worker_ipc"}
# Read beyond the folders unpacked whole (entrypoints, managers, arg_groups, api).
SCHEDULER_UPDATER = "srt/managers/scheduler_components/weight_updater.py"
RUNNER_UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"
WEIGHT_CHECKER = "srt/utils/weight_checker.py"
WHEEL_FILES = (RUNNER_UPDATER, WEIGHT_CHECKER)


def sglang_pin() -> str:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    [pin] = [line for line in extras["sglang"] if line.startswith("sglang==")]
    return pin.removeprefix("sglang==")


@pytest.fixture(scope="module")
def wheel_source() -> Path:
    """The unpacked wheel of the pinned SGLang (downloaded once, then cached)."""
    version = sglang_pin()
    folder = CACHE / version
    read = (*WHEEL_FILES, "srt/entrypoints/http_server.py", "srt/arg_groups/fields/serving.py")
    if not all((folder / "sglang" / path).is_file() for path in read):
        download = CACHE / f"{version}.download"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(download),
                f"sglang=={version}",
            ],
            check=True,
            timeout=600,
        )
        [wheel] = download.glob("sglang-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            members = [
                name
                for name in archive.namelist()
                if name.startswith(
                    (
                        "sglang/srt/entrypoints/",
                        "sglang/srt/managers/",
                        "sglang/srt/arg_groups/",
                        "sglang/api/",
                        *(f"sglang/{path}" for path in WHEEL_FILES),
                    )
                )
            ]
            archive.extractall(folder, members)
    return folder


# ------------------------------------------------------------------------------ reading the wheel
@dataclass(frozen=True)
class Route:
    methods: frozenset[str]
    request_type: str | None  # the io_struct class of its body, None: no body model


@dataclass(frozen=True)
class RequestType:
    fields: frozenset[str]
    required: frozenset[str]
    annotations: dict[str, ast.expr] = field(default_factory=dict, compare=False)


def _type_name(annotation: ast.expr | None) -> str | None:
    """`X`, `Annotated[X, ...]`, `Optional[X]` -> "X"."""
    if isinstance(annotation, ast.Name):
        return annotation.id
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id in ("Annotated", "Optional")
    ):
        inner = annotation.slice
        return _type_name(inner.elts[0] if isinstance(inner, ast.Tuple) else inner)
    return None


def _route_path(decorator: ast.expr) -> str | None:
    """The path of `@app.<verb>("/path", ...)`; None for another decorator."""
    if (
        isinstance(decorator, ast.Call)
        and isinstance(decorator.func, ast.Attribute)
        and isinstance(decorator.func.value, ast.Name)
        and decorator.func.value.id == "app"
        and decorator.args
        and isinstance(first := decorator.args[0], ast.Constant)
    ):
        return str(first.value)
    return None


def _handlers(http_server: Path) -> typing.Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(ast.parse(http_server.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def read_routes(http_server: Path) -> dict[str, Route]:
    routes: dict[str, Route] = {}
    for node in _handlers(http_server):
        body_type = next(
            (name for arg in node.args.args if (name := _type_name(arg.annotation))), None
        )
        for decorator in node.decorator_list:
            path = _route_path(decorator)
            if path is None:
                continue
            assert isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            verb = decorator.func.attr
            if verb == "api_route":
                [methods] = [k.value for k in decorator.keywords if k.arg == "methods"]
                assert isinstance(methods, ast.List)
                verbs = {str(ast.literal_eval(m)) for m in methods.elts}
            else:
                verbs = {verb.upper()}
            routes[path] = Route(frozenset(verbs), body_type)
    return routes


# The routes whose handler answers a struct (`msgspec_to_builtins(result)`), by its io_struct type.
ANSWER_TYPES = {
    "/load_lora_adapter_from_tensors": "LoRAUpdateOutput",
    "/unload_lora_adapter": "LoRAUpdateOutput",
}


def read_answer_keys(http_server: Path, path: str) -> frozenset[str]:
    """The keys the handler of `path` can put in its answer: those of its dict literals and of
    its `body["key"] = ...` assignments."""
    for node in _handlers(http_server):
        if path not in {_route_path(decorator) for decorator in node.decorator_list}:
            continue
        keys: set[str] = set()
        for inner in ast.walk(node):
            if isinstance(inner, ast.Dict):
                keys |= {
                    key.value
                    for key in inner.keys
                    if isinstance(key, ast.Constant) and isinstance(key.value, str)
                }
            elif (
                isinstance(inner, ast.Subscript)
                and isinstance(inner.ctx, ast.Store)
                and isinstance(inner.slice, ast.Constant)
            ):
                keys.add(str(inner.slice.value))
        return frozenset(keys)
    raise AssertionError(f"the wheel has no handler for {path}")


def read_request_types(*sources: Path) -> dict[str, RequestType]:
    """Every class of `sources` with its annotated fields, inherited ones included."""
    classes: dict[str, ast.ClassDef] = {}
    for source in sources:
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)

    def fields(name: str) -> dict[str, tuple[bool, ast.expr]]:  # field -> (has a default, type)
        node = classes.get(name)
        if node is None:
            return {}
        found: dict[str, tuple[bool, ast.expr]] = {}
        for base in node.bases:
            if isinstance(base, ast.Name):
                found |= fields(base.id)
        for item in node.body:
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and "ClassVar" not in ast.unparse(item.annotation)
            ):
                found[item.target.id] = (item.value is not None, item.annotation)
        return found

    request_types = {}
    for name in classes:
        declared = fields(name)
        request_types[name] = RequestType(
            frozenset(declared),
            frozenset(f for f, (default, _) in declared.items() if not default),
            {f: annotation for f, (_, annotation) in declared.items()},
        )
    return request_types


@pytest.fixture(scope="module")
def contract(wheel_source):
    srt = wheel_source / "sglang" / "srt"
    routes = read_routes(srt / "entrypoints" / "http_server.py")
    types = read_request_types(srt / "managers" / "io_struct.py")
    api = read_request_types(wheel_source / "sglang" / "api" / "v1" / "api_types.py")
    return routes, types, api["SamplingParams"]


def problems_with(path: str, method: str, body, contract) -> list[str]:
    """What is wrong with sending `body` to `method path` of the wheel's server."""
    routes, request_types, sampling = contract
    route = routes.get(path)
    if route is None:
        return [f"{method} {path}: the wheel has no such route"]
    if method not in route.methods:
        return [f"{method} {path}: the wheel serves it for {sorted(route.methods)} only"]
    if route.request_type is None or route.request_type not in request_types:
        return [] if not body else [f"{path}: the wheel takes no body, the project sends {body}"]
    declared = request_types[route.request_type]
    sent = set(body or {})
    found = [
        f"{path}: {route.request_type} declares no field {field!r}"
        for field in sorted(sent - declared.fields)
    ]
    found += [
        f"{path}: {route.request_type} requires {field!r}, the project leaves it out"
        for field in sorted(declared.required - sent - _IPC_FIELDS)
    ]
    if path == "/generate":
        params = set((body or {}).get("sampling_params") or {})
        found += [
            f"/generate: sampling_params.{field} is not in the API's SamplingParams (unknown "
            "keys are a 400)"
            for field in sorted(params - sampling.fields)
        ]
    return found


# ------------------------------------------------------------------------------ field types
# A JSON kind: "null", "bool", "int", "float", "str", "object", "any", or ("list", item kinds).
Kind = str | tuple[str, frozenset]
_NAMED_KINDS: dict[str, frozenset[Kind]] = {
    "None": frozenset({"null"}),
    "bool": frozenset({"bool"}),
    "int": frozenset({"int"}),
    "float": frozenset({"float"}),
    "str": frozenset({"str"}),
    # msgspec's `Base64Bytes` (the adapter load's tensors): a base64 string on the wire.
    "bytes": frozenset({"str"}),
    "dict": frozenset({"object"}),
    "Dict": frozenset({"object"}),
    "Any": frozenset({"any"}),
    "list": frozenset({("list", frozenset({"any"}))}),
    "List": frozenset({("list", frozenset({"any"}))}),
}


class KindReader:
    """The JSON kinds a field's annotation in the wheel's source admits, through the type
    aliases its module defines (`Int64List = List[int]`); a name it cannot resolve is the kind
    "?Name", which admits nothing, so that an unread type fails the check instead of passing."""

    def __init__(self, source: Path):
        self._aliases = {
            node.targets[0].id: node.value
            for node in ast.parse(source.read_text()).body
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        }

    def kinds(self, node: ast.expr) -> frozenset[Kind]:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):  # a forward reference
                return self.kinds(ast.parse(node.value, mode="eval").body)
            return frozenset({"null"}) if node.value is None else frozenset({"?"})
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.kinds(node.left) | self.kinds(node.right)
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in _NAMED_KINDS:
                return _NAMED_KINDS[name]
            alias = self._aliases.get(name)
            return self.kinds(alias) if alias is not None else frozenset({f"?{name}"})
        if isinstance(node, ast.Subscript):
            outer = ast.unparse(node.value).rsplit(".", 1)[-1]
            args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
            if outer in ("Annotated", "A"):
                return self.kinds(args[0])
            if outer == "Optional":
                return self.kinds(args[0]) | {"null"}
            if outer == "Union":
                return frozenset().union(*(self.kinds(arg) for arg in args))
            if outer in ("List", "list", "Sequence"):
                return frozenset({("list", self.kinds(args[0]))})
            if outer in ("Dict", "dict", "Mapping"):
                return frozenset({"object"})
            if outer == "Literal":
                return frozenset().union(*(_value_kinds(literal_values(node))))
        return frozenset({f"?{ast.unparse(node)}"})


def literal_values(node: ast.expr) -> list:
    """The values of `Literal[...]`."""
    assert isinstance(node, ast.Subscript)
    args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return [ast.literal_eval(arg) for arg in args]


def _value_kinds(values: Iterable) -> list[frozenset[Kind]]:
    return [_kinds_of_python_type(type(value)) for value in values]


def _kinds_of_python_type(hint) -> frozenset[Kind]:
    """The JSON kinds a pydantic annotation of the stand-in admits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return frozenset({"null"})
    if hint is typing.Any:
        return frozenset({"any"})
    if origin in (typing.Union, types.UnionType):
        return frozenset().union(*(_kinds_of_python_type(arg) for arg in args))
    if origin is list:
        return frozenset({("list", _kinds_of_python_type(args[0]))})
    if origin is typing.Literal:
        return frozenset().union(*_value_kinds(args))
    if origin is dict or (isinstance(hint, type) and issubclass(hint, BaseModel)):
        return frozenset({"object"})
    if hint in (bool, int, float, str):
        return frozenset({hint.__name__})
    return frozenset({f"?{hint}"})


def covers(admitted: frozenset[Kind], kind: Kind) -> bool:
    """Whether what `kind` admits is admitted by `admitted` (a JSON int is a float too)."""
    if "any" in admitted:
        return True
    if isinstance(kind, tuple):
        return any(
            isinstance(outer, tuple) and all(covers(outer[1], inner) for inner in kind[1])
            for outer in admitted
        )
    return kind in admitted or (kind == "int" and "float" in admitted)


def admits(admitted: frozenset[Kind], value) -> bool:
    """Whether a JSON `value` is of a kind in `admitted`."""
    if "any" in admitted:
        return True
    if isinstance(value, list):
        return any(
            isinstance(kind, tuple) and all(admits(kind[1], item) for item in value)
            for kind in admitted
        )
    if isinstance(value, dict):
        return "object" in admitted
    scalar = "null" if value is None else type(value).__name__
    return covers(admitted, scalar)


def type_problems(path: str, body, contract, readers: dict[str, KindReader]) -> list[str]:
    """Fields of `body` whose values the wheel's request type of `path` does not admit."""
    routes, request_types, sampling = contract
    route = routes.get(path)
    if route is None or route.request_type not in request_types or not body:
        return []
    declared = request_types[route.request_type]
    found = [
        f"{path}: {name}={value!r} is not a {ast.unparse(declared.annotations[name])}"
        for name, value in body.items()
        if name in declared.annotations
        and not admits(readers["io_struct"].kinds(declared.annotations[name]), value)
    ]
    if path == "/generate":
        found += [
            f"/generate: sampling_params.{name}={value!r} is not a "
            f"{ast.unparse(sampling.annotations[name])}"
            for name, value in (body.get("sampling_params") or {}).items()
            if name in sampling.annotations
            and not admits(readers["api"].kinds(sampling.annotations[name]), value)
        ]
    return found


@pytest.fixture(scope="module")
def readers(wheel_source) -> dict[str, KindReader]:
    return {
        "io_struct": KindReader(wheel_source / "sglang" / "srt" / "managers" / "io_struct.py"),
        "api": KindReader(wheel_source / "sglang" / "api" / "v1" / "api_types.py"),
    }


# ------------------------------------------------------------------------------ the project's calls
@pytest.fixture(scope="module")
def recorded_calls(tmp_path_factory) -> list[tuple[str, dict | None]]:
    """Every request the client sends in generation, a disk refit of the weights the servers
    started with (snapshot, reset, compare) and a broadcast refit (read back, checksums), as two
    stand-ins saw them."""
    tmp_path = tmp_path_factory.mktemp("recorded")
    weights = {
        "model.embed_tokens.weight": torch.randn(8, 4),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
        "model.norm.weight": torch.randn(4),
    }
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_file(weights, str(checkpoint / "model.safetensors"))
    standins = [make_standin(model_weights=weights) for _ in range(2)]
    servers = [serve_in_thread(app) for app, _ in standins]
    urls = [server.url for server in servers]
    checker = WeightsChecker(every=1, timeout_s=20.0, skip_tensors=("rotary_emb.inv_freq",))
    try:
        with SGLangEngine(
            urls,
            request_timeout_s=20.0,
            refit_timeout_s=20.0,
            weights_checker=checker,
            honours_seeds=True,
        ) as engine:
            request = GenerationRequest(
                [1, 2, 3], SamplingParams(max_new_tokens=3, stop_token_ids=(9,), seed=4)
            )
            engine.generate([request])
            engine.refit_from_disk(checkpoint, 0)
            check = ReadBackCheck(every=0, rows=2, served_dtype=None, timeout_s=20.0)
            sender = WeightSender(
                urls,
                [1, 1],
                master_address="127.0.0.1",
                backend="gloo",
                bucket_bytes=1 << 20,
                timeout_s=20.0,
                check=check,
            )
            engine.begin_refit(1)
            sender.send(weights.items(), 1)
            engine.end_refit(1)
            sender.close()
        # A LoRA run's: adapters loaded from tensors, named by requests, one unloaded.
        serving = AdapterServing(
            rank=2, target_modules=("q_proj",), versions_kept=1, backend="torch_native"
        )
        key = "base_model.model.model.layers.0.self_attn.q_proj"
        adapter = AdapterWeights(
            {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]},
            {f"{key}.lora_A.weight": torch.randn(2, 4), f"{key}.lora_B.weight": torch.zeros(4, 2)},
        )
        with SGLangEngine(
            urls, request_timeout_s=20.0, refit_timeout_s=20.0, weight_version=1, adapters=serving
        ) as engine:  # the base: the weights the broadcast above sent, version 1
            engine.update_adapter(adapter, 2)
            engine.update_adapter(adapter, 3)
            engine.generate([GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=2))])
    finally:
        for server in servers:
            server.close()
    checked = [body["action"] for path, body in standins[0][1].requests if path == ROUTE]
    assert checked == ["snapshot", "compare", "snapshot", "reset_tensors", "compare", "checksum"]
    return [call for _, state in standins for call in state.requests]


def test_the_project_calls_only_what_the_pinned_wheel_serves(contract, readers, recorded_calls):
    """Routes, fields, required fields and each sent value's type."""
    calls = recorded_calls
    found = [
        problem for path, body in calls for problem in problems_with(path, "POST", body, contract)
    ]
    found += [
        problem for path, body in calls for problem in type_problems(path, body, contract, readers)
    ]
    # GETs without a body: the servers' start-up health poll (SGLangServerProcess.wait_healthy)
    # and the liveness probe after a failed refit (WeightSender._liveness).
    unrecorded = ("/health_generate", LIVENESS_ROUTE)
    found += [
        problem for path in unrecorded for problem in problems_with(path, "GET", None, contract)
    ]
    assert not found, f"against sglang=={sglang_pin()}:\n" + "\n".join(found)
    called = {path for path, _ in calls} | set(unrecorded)
    routes, _, _ = contract
    for module in CLIENT_MODULES:
        text = (CLIENT_FOLDER / module).read_text()
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"/[a-z_]+", node.value)
            ):
                assert node.value in routes, f"{module} calls {node.value}: not in the wheel"
                assert node.value in called, f"{module} calls {node.value}: not exercised"


def test_a_field_the_wheel_does_not_declare_is_caught(contract, readers):
    """The checker itself: misspelt, extra and missing fields and values of another type are
    reported."""
    body = {"names": ["w"], "dtypes": ["float32"], "group_name": "g", "flush": False}
    found = problems_with("/update_weights_from_distributed", "POST", body, contract)
    assert any("no field 'flush'" in problem for problem in found)
    assert any("requires 'shapes'" in problem for problem in found)
    assert problems_with("/begin_weight_updates", "POST", {}, contract)
    generate = {"input_ids": [1], "sampling_params": {"max_tokens": 3}}
    assert problems_with("/generate", "POST", generate, contract) == [
        "/generate: sampling_params.max_tokens is not in the API's SamplingParams (unknown keys "
        "are a 400)"
    ]
    update = body | {"shapes": [[2]], "weight_version": 3}  # SGLang's versions are strings
    assert type_problems("/update_weights_from_distributed", update, contract, readers) == [
        "/update_weights_from_distributed: weight_version=3 is not a Optional[str]"
    ]
    generate = {"input_ids": [1.5], "sampling_params": {"stop_token_ids": ["2"]}}
    assert len(type_problems("/generate", generate, contract, readers)) == 2
    assert not type_problems("/generate", {"input_ids": [[1], [2]]}, contract, readers)


def _standin_models() -> dict[str, tuple[frozenset[str], type[BaseModel] | None]]:
    app, _ = make_standin()
    found = {}
    for route in app.routes:
        path, methods, endpoint = (
            getattr(route, "path", ""),
            getattr(route, "methods", None),
            getattr(route, "endpoint", None),
        )
        if not methods or endpoint is None or path.startswith(("/docs", "/openapi", "/redoc")):
            continue
        hints = typing.get_type_hints(endpoint)
        model = next(
            (
                candidate
                for name, hint in hints.items()
                if name != "return"
                for candidate in (hint, *typing.get_args(hint))  # X, or X | None: optional body
                if isinstance(candidate, type) and issubclass(candidate, BaseModel)
            ),
            None,
        )
        found[path] = (frozenset(methods), model)
    return found


def test_the_standin_serves_the_wheels_routes_with_its_request_types(contract, readers):
    """Routes, methods, fields, required fields, and each field's type admits nothing the
    wheel's does not (it may admit less: the stand-in is stricter)."""
    routes, request_types, sampling = contract
    found = []
    for path, (methods, model) in _standin_models().items():
        route = routes.get(path)
        if route is None:
            found.append(f"the stand-in serves {path}, the wheel does not")
            continue
        if not methods <= route.methods:
            found.append(
                f"{path}: stand-in methods {sorted(methods)}, wheel {sorted(route.methods)}"
            )
        if model is None or route.request_type not in request_types:
            continue
        declared = request_types[route.request_type]
        own = {name for name, info in model.model_fields.items()}
        required = {name for name, info in model.model_fields.items() if info.is_required()}
        found += [
            f"{path}: the stand-in accepts {name!r}, {route.request_type} has no such field"
            for name in sorted(own - declared.fields)
        ]
        found += _standin_type_problems(path, model, declared, readers["io_struct"])
        if required != declared.required - _IPC_FIELDS:
            found.append(
                f"{path}: the stand-in requires {sorted(required)}, {route.request_type} "
                f"requires {sorted(declared.required - _IPC_FIELDS)}"
            )
        if path == "/generate":
            params = model.model_fields["sampling_params"].annotation
            inner = next(a for a in typing.get_args(params) if isinstance(a, type))
            found += [
                f"/generate: the stand-in's sampling_params accepts {name!r}, the API does not"
                for name in sorted(set(inner.model_fields) - sampling.fields)
            ]
            found += _standin_type_problems(path, inner, sampling, readers["api"])
    assert not found, f"against sglang=={sglang_pin()}:\n" + "\n".join(found)


def _standin_type_problems(
    path: str, model: type[BaseModel], declared: RequestType, reader: KindReader
) -> list[str]:
    found = []
    for name, info in model.model_fields.items():
        if name not in declared.annotations:
            continue  # reported as a field the wheel lacks
        wheel = reader.kinds(declared.annotations[name])
        standin = _kinds_of_python_type(info.annotation)
        if not all(covers(wheel, kind) for kind in standin):
            found.append(
                f"{path}: the stand-in's {model.__name__}.{name} is {info.annotation}, the wheel "
                f"declares {ast.unparse(declared.annotations[name])}"
            )
    return found


def _yarn_policy() -> PolicyConfig:
    """A pretrained MoE policy whose flags include YaRN and router replay's routed experts, so
    the launcher writes its widest command."""
    return PolicyConfig(
        name="m",
        source="pretrained",
        path="/m",
        max_total_sequence_length=65536,
        native_context_length=32768,
        yarn={"factor": 2.0, "original_max_position_embeddings": 32768},
        is_moe=True,
        router_replay={"enabled": True},
    )


def test_the_standins_weights_checker_answers_in_the_wheels_shape(wheel_source, tmp_path):
    """The keys the client reads (`success`, `message`, `per_engine_checksum`) and the checksum's
    `ranks`, as the wheel's handler and wire types (`ChecksumInfo`, `ParallelismInfo`) make
    them."""
    srt = wheel_source / "sglang" / "srt"
    keys = read_answer_keys(srt / "entrypoints" / "http_server.py", ROUTE)
    assert {"success", "message", "ranks", "per_engine_checksum"} <= keys
    wire = read_request_types(srt / "managers" / "io_struct.py")
    app, _ = make_standin(model_weights={"model.norm.weight": torch.ones(4)})
    server = serve_in_thread(app)
    try:
        with httpx.Client(timeout=20.0) as client:
            answers = [
                client.post(f"{server.url}{ROUTE}", json=body)
                for body in (
                    {"action": "checksum"},
                    {"action": "snapshot"},
                    {"action": "reset_tensors"},
                    {"action": "compare"},
                )
            ]
    finally:
        server.close()
    checksum, _, _, compare = answers
    for answer in answers:
        assert set(answer.json()) <= keys, answer.json()
    assert compare.status_code == 400 and not compare.json()["success"]  # reset, not refitted
    assert compare.json()["message"].startswith("check tensor equality failed:\nname=model.norm")
    [rank] = checksum.json()["ranks"]
    assert set(rank) == wire["ChecksumInfo"].fields
    for placement in rank["parallelism_info"]:  # one per runner (`List[ParallelismInfo]`)
        assert set(placement) == wire["ParallelismInfo"].fields
    assert isinstance(checksum.json()["per_engine_checksum"], str)


def _adapter_serving() -> AdapterServing:
    """A LoRA run's: every module of the default target set (each a value of the
    `--lora-target-modules` list)."""
    grpo = GRPOConfig(num_steps=1, num_prompts_per_step=1, num_generations_per_prompt=2)
    serving = AdapterServing.of(LoraConfig(enabled=True), grpo, SGLangLaunchConfig())
    assert serving is not None
    return serving


def test_every_flag_the_launcher_can_pass_is_a_server_argument(wheel_source):
    """`server_command` with every optional flag on; SGLang's CLI flags are its ServerArgs
    fields, `_` written `-` (`arg_groups/arg_utils.py`)."""
    fields = set()
    for module in (wheel_source / "sglang" / "srt" / "arg_groups" / "fields").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add(node.target.id)
    launch = SGLangLaunchConfig(
        device="cpu",
        attention_backend="triton",
        cuda_graphs=False,
        max_total_tokens=1024,
        skip_server_warmup=True,
        deterministic_inference=True,
    )
    generation = SGLangGenerationConfig(expert_parallel_size=2, launch=launch)
    policy = _yarn_policy()
    command = server_command(
        generation, policy, model_path="/m", port=1, seed=0, adapters=_adapter_serving()
    )
    flags = [word.split("=")[0] for word in command if word.startswith("--")]
    assert "--enable-lora" in flags and "--lora-strict-loading" in flags
    assert "--json-model-override-args" in flags and "--enable-deterministic-inference" in flags
    assert "--enable-return-routed-experts" in flags
    unknown = [flag for flag in flags if flag[2:].replace("-", "_") not in fields]
    assert unknown == [], f"flags SGLang {sglang_pin()} does not take: {unknown}"


def _arg_choices(annotation: ast.expr, choices_source: Path) -> list | None:
    """The `choices=` of a field's `Arg(...)` (a list, or a list named in
    `arg_groups/choices.py`), or a `Literal`'s values; None: the flag takes any value of its
    type."""
    args = annotation.slice.elts if isinstance(annotation, ast.Subscript) else []
    args = args if isinstance(args, list) else []
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
            return literal_values(node)
    for arg in args:
        if not (isinstance(arg, ast.Call) and ast.unparse(arg.func) == "Arg"):
            continue
        for keyword in arg.keywords:
            if keyword.arg != "choices":
                continue
            if isinstance(keyword.value, ast.List):
                return ast.literal_eval(keyword.value)
            if isinstance(keyword.value, ast.Name):
                for node in ast.parse(choices_source.read_text()).body:
                    if (
                        isinstance(node, ast.Assign)
                        and ast.unparse(node.targets[0]) == keyword.value.id
                        and isinstance(node.value, ast.List)
                    ):
                        return [
                            item.value for item in node.value.elts if isinstance(item, ast.Constant)
                        ]
    return None


def _flag_value_problem(
    flag: str, value: str | None, annotation: ast.expr, reader: KindReader, choices: list | None
) -> str | None:
    """Why the server's argument parser would not take `flag value` (None: it would)."""
    kinds = reader.kinds(annotation) - {"null"}
    if kinds == {"bool"}:
        return None if value is None else f"{flag} is a switch, the launcher gives it {value!r}"
    if value is None:
        return f"{flag} takes a value ({ast.unparse(annotation)[:60]}), the launcher gives none"
    if choices is not None and value not in choices:
        return f"{flag} {value!r}: not one of the wheel's choices {choices}"
    parsers = {"int": int, "float": float, "str": str}
    # A list's flag takes its items as values (nargs, `--lora-target-modules q_proj k_proj`).
    items = {item for kind in kinds if isinstance(kind, tuple) for item in kind[1]}
    for kind in kinds | items:
        parse = parsers.get(kind) if isinstance(kind, str) else None
        if parse is None:
            continue
        try:
            parse(value)
        except ValueError:
            continue
        return None
    return f"{flag} {value!r}: not a {sorted(map(str, kinds))}"


def test_every_flag_the_launcher_passes_takes_the_value_it_is_given(wheel_source):
    """Each flag's value parses as its ServerArgs field's type and is one of its choices, and
    switches come without a value: `server_command` for the flagship and for the CPU server."""
    fields_folder = wheel_source / "sglang" / "srt" / "arg_groups" / "fields"
    choices_source = wheel_source / "sglang" / "srt" / "arg_groups" / "choices.py"
    annotations: dict[str, tuple[ast.expr, KindReader]] = {}
    for module in fields_folder.glob("*.py"):
        reader = KindReader(module)
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                annotations[node.target.id] = (node.annotation, reader)
    policy = _yarn_policy()
    cpu = cpu_generation().launch  # what the sglang_cpu tests start the real server with

    def problem(flag: str, value: str | None) -> str | None:
        annotation, reader = annotations[flag[2:].replace("-", "_")]
        choices = _arg_choices(annotation, choices_source)
        return _flag_value_problem(flag, value, annotation, reader, choices)

    # The checker itself: a value of another type, one outside the choices, a switch given a
    # value and a flag left without one are each reported.
    for flag, value in [
        ("--tp-size", "two"),
        ("--attention-backend", "cuda_magic"),
        ("--cuda-graph-backend-decode", "off"),
        ("--skip-server-warmup", "1"),
        ("--mem-fraction-static", None),
    ]:
        assert problem(flag, value) is not None, (flag, value)
    found = []
    for generation in (
        SGLangGenerationConfig(expert_parallel_size=2, tensor_parallel_size=4),
        SGLangGenerationConfig(launch=cpu),
    ):
        command = server_command(
            generation, policy, model_path="/m", port=1, seed=0, adapters=_adapter_serving()
        )
        for index, word in enumerate(command):
            if not word.startswith("--"):
                continue
            flag, _, inline = word.partition("=")
            following = command[index + 1] if index + 1 < len(command) else None
            value = inline or (following if following and not following.startswith("--") else None)
            said = problem(flag, value)
            if said is not None:
                found.append(said)
    assert found == [], f"against sglang=={sglang_pin()}:\n" + "\n".join(found)


# ------------------------------------------------------------------------------ answer keys
def _dict_keys(nodes: Iterable[ast.AST]) -> set[str]:
    return {
        key.value
        for node in nodes
        if isinstance(node, ast.Dict)
        for key in node.keys
        if isinstance(key, ast.Constant) and isinstance(key.value, str)
    }


def read_meta_info_keys(tokenizer_manager: Path) -> frozenset[str]:
    """The keys `/generate`'s `meta_info` can hold: those of dicts assigned to `meta_info`, of
    `meta_info.update({...})` and of `meta_info["key"] = ...`."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse(tokenizer_manager.read_text())):
        if isinstance(node, ast.Assign) and any(
            ast.unparse(target) == "meta_info" for target in node.targets
        ):
            keys |= _dict_keys([node.value])
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "meta_info.update"
            and node.args
        ):
            keys |= _dict_keys([node.args[0]])
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and ast.unparse(node.value) == "meta_info"
            and isinstance(node.slice, ast.Constant)
        ):
            keys.add(str(node.slice.value))
    return frozenset(keys)


def read_finish_reason_keys(schedule_batch: Path) -> frozenset[str]:
    """The keys of every finish reason's `to_json()`."""
    return frozenset(
        _dict_keys(
            inner
            for node in ast.walk(ast.parse(schedule_batch.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name == "to_json"
            for inner in ast.walk(node)
        )
    )


def client_read_keys() -> set[str]:
    """Every string the client's modules look up in a parsed answer: `x["key"]` and
    `x.get("key")`."""
    keys = set()
    for module in CLIENT_MODULES:
        for node in ast.walk(ast.parse((CLIENT_FOLDER / module).read_text())):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                keys.add(node.slice.value)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                keys.add(node.args[0].value)
    return keys


def test_the_wheel_answers_every_key_the_client_reads(wheel_source):
    """`sglang_answers.CLIENT_READS` lists every key the client's modules read (a header aside),
    and the wheel's server makes each: the control routes' handlers, `/generate`'s answer, its
    `meta_info` and its finish reasons."""
    listed = {key for paths in CLIENT_READS.values() for path in paths for key in path.split(".")}
    headers = {"content-type"}
    assert client_read_keys() - headers == listed
    srt = wheel_source / "sglang" / "srt"
    http_server = srt / "entrypoints" / "http_server.py"
    answer_types = read_request_types(srt / "managers" / "io_struct.py")
    made = {
        "meta_info": read_meta_info_keys(srt / "managers" / "tokenizer_manager.py"),
        "finish_reason": read_finish_reason_keys(srt / "managers" / "schedule_batch.py"),
    }
    answer_of_generate = _dict_keys(
        ast.walk(ast.parse((srt / "managers" / "tokenizer_manager.py").read_text()))
    )
    found = []
    for route, paths in CLIENT_READS.items():
        for path in paths:
            *parents, key = path.split(".")
            if parents:
                keys = made[parents[-1]]
                if parents[0] not in answer_of_generate:
                    found.append(f"{route}: the wheel's answer has no {parents[0]!r}")
            elif route in ANSWER_TYPES:  # answered as msgspec_to_builtins(result)
                keys = answer_types[ANSWER_TYPES[route]].fields
            else:
                keys = read_answer_keys(http_server, route)
            if key not in keys:
                found.append(f"{route}: the client reads {path}, the wheel never answers it")
    assert found == [], f"against sglang=={sglang_pin()}:\n" + "\n".join(found)


# ------------------------------------------------------------------------------ weight updates
# The scheduler's method each weight route of the client reaches (http_server ->
# tokenizer_manager -> scheduler), and those of them whose work is the model runner's updater.
SCHEDULER_METHODS = {
    "/init_weights_update_group": "init_weights_update_group",
    "/destroy_weights_update_group": "destroy_weights_update_group",
    "/begin_weight_update": "begin_weight_update",
    "/end_weight_update": "end_weight_update",
    "/update_weights_from_distributed": "update_weights_from_distributed",
    "/update_weights_from_disk": "update_weights_from_disk",
    "/get_weights_by_name": "get_weights_by_name",
    ROUTE: "check_weights",
}
RUNNER_LOADS = {
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/update_weights_from_disk",
}


def _methods(source: Path) -> dict[str, ast.FunctionDef]:
    return {
        node.name: node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.FunctionDef)
    }


def _parameters(method: ast.FunctionDef) -> set[str]:
    arguments = method.args
    return {arg.arg for arg in [*arguments.args, *arguments.kwonlyargs, *arguments.posonlyargs]}


def test_the_servers_updaters_do_what_the_client_asks(wheel_source, recorded_calls):
    """Behind the routes: every weight route the client calls reaches a scheduler method; those
    that load weights call the model runner's updater with arguments it takes; its distributed
    receive handles the client's `load_format`; the weights checker handles every action the
    client sends and fails a compare with the message the client reads as a mismatch."""
    srt = wheel_source / "sglang" / "srt"
    scheduler = _methods(wheel_source / "sglang" / SCHEDULER_UPDATER)
    runner = _methods(wheel_source / "sglang" / RUNNER_UPDATER)
    called = {path for path, _ in recorded_calls} - {"/generate", "/flush_cache"}
    called -= {"/pause_generation", "/continue_generation"}
    # The adapter routes reach the scheduler's LoRA manager, not its weight updater; their
    # contract is their request type and their answer (LoRAUpdateOutput), checked above.
    called -= set(ANSWER_TYPES)
    found = [f"{route}: no scheduler method listed" for route in called - set(SCHEDULER_METHODS)]
    for route in sorted(called & set(SCHEDULER_METHODS)):
        method = scheduler.get(SCHEDULER_METHODS[route])
        if method is None:
            found.append(f"{route}: the scheduler has no {SCHEDULER_METHODS[route]}()")
            continue
        calls = [
            node
            for node in ast.walk(method)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in runner
        ]
        if route in RUNNER_LOADS and not calls:
            found.append(f"{route}: {method.name}() calls nothing of the model runner's updater")
        for call in calls:
            assert isinstance(call.func, ast.Attribute)
            target = runner[call.func.attr]
            unknown = {k.arg for k in call.keywords if k.arg} - _parameters(target)
            if unknown:
                found.append(f"{route}: {target.name}() takes no {sorted(unknown)}")
    receive = runner["receive_weights_from_distributed"]
    compared = {
        node.value
        for compare in ast.walk(receive)
        if isinstance(compare, ast.Compare)
        for node in ast.walk(compare)
        if isinstance(node, ast.Constant)
    }
    if FLATTENED_BUCKET not in compared:
        found.append(f"receive_weights_from_distributed() does not handle {FLATTENED_BUCKET!r}")
    checker = ast.parse((srt / "utils" / "weight_checker.py").read_text())
    handled = {
        node.comparators[0].value
        for node in ast.walk(checker)
        if isinstance(node, ast.Compare)
        and ast.unparse(node.left) == "action"
        and isinstance(node.comparators[0], ast.Constant)
    }
    sent = {body["action"] for path, body in recorded_calls if path == ROUTE and body}
    found += [f"weight_checker.py handles no action {action!r}" for action in sent - handled]
    messages = [
        node.value
        for node in ast.walk(checker)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    if not any(message.startswith(MISMATCH_PREFIX) for message in messages):
        found.append(f"weight_checker.py makes no message starting {MISMATCH_PREFIX!r}")
    assert sent == {"snapshot", "reset_tensors", "compare", "checksum"}
    assert found == [], f"against sglang=={sglang_pin()}:\n" + "\n".join(found)
