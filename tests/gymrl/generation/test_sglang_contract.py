"""The SGLang HTTP contract, read from the pinned wheel's own source.

The SGLang client and the stand-in the CPU tests run against (`sglang_standin.py`) were written
from the project's reading of SGLang, so they agree with each other whatever SGLang does. This
test downloads `sglang==<pin>` (the pin of pyproject.toml) without dependencies, never installs
or imports it, and parses with `ast`:

* the route table of `sglang/srt/entrypoints/http_server.py` (path, methods, the request type
  each handler takes),
* the request types of `sglang/srt/managers/io_struct.py` (dataclasses and msgspec structs:
  every field, and which have no default), and the wire types of the weight checker's answer
  (`ChecksumInfo`, `ParallelismInfo`),
* the keys `/weights_checker`'s handler puts in its answer,
* `sglang/api/v1/api_types.py`'s `SamplingParams`, the schema `/generate` checks its
  `sampling_params` against (unknown keys rejected),
* the server's arguments (`sglang/srt/arg_groups/fields/*.py`, one `--flag-name` per field), which
  every flag the launcher can pass must name.

It then runs the project's client through every call it makes (generation, a disk refit checked
by the weights checker's snapshot, reset and compare, a broadcast refit with the read-back check
and the checksums) against two stand-ins, which record each request, and fails on a route the
wheel lacks, a field its request type does not declare, or a required field left out; every
route string in the client's modules must be in the wheel and in that run. The stand-in's routes
and request models are checked against the same table, its weight-checker answers against the
wheel's keys and wire types. When the pin moves, the failures list what changed. The download
needs the network: marked `registry`, as CI runs (`.ci/run`); the wheel is cached under
~/.cache/gym-grpo-recipes/sglang-wheel/.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import typing
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import save_file
from sglang_standin import make_standin

from gymrl.config.schema.generation import SGLangGenerationConfig, SGLangLaunchConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.sglang_engine import SGLangEngine
from gymrl.generation.sglang_servers import server_command
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.generation.verify_read_back import ReadBackCheck
from gymrl.generation.verify_weights_checker import ROUTE, WeightsChecker
from gymrl.generation.weight_sync import WeightSender
from nemo_gym_ext.http_server import serve_in_thread

pytestmark = pytest.mark.registry

ROOT = Path(__file__).resolve().parents[3]
CACHE = Path("~/.cache/gym-grpo-recipes/sglang-wheel").expanduser()
CLIENT_MODULES = (
    "sglang_engine.py",
    "sglang_servers.py",
    "weight_sync.py",
    "verify_read_back.py",
    "verify_weights_checker.py",
)
# Fields every io_struct request inherits for SGLang's own IPC; a client never sends them.
_IPC_FIELDS = {"rid", "http_worker_ipc"}


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
    read = ("srt/entrypoints/http_server.py", "srt/arg_groups/fields/serving.py")
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

    def fields(name: str) -> dict[str, bool]:  # field -> has a default
        node = classes.get(name)
        if node is None:
            return {}
        found: dict[str, bool] = {}
        for base in node.bases:
            if isinstance(base, ast.Name):
                found |= fields(base.id)
        for item in node.body:
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and "ClassVar" not in ast.unparse(item.annotation)
            ):
                found[item.target.id] = item.value is not None
        return found

    types = {}
    for name in classes:
        declared = fields(name)
        types[name] = RequestType(
            frozenset(declared), frozenset(f for f, default in declared.items() if not default)
        )
    return types


@pytest.fixture(scope="module")
def contract(wheel_source):
    srt = wheel_source / "sglang" / "srt"
    routes = read_routes(srt / "entrypoints" / "http_server.py")
    types = read_request_types(srt / "managers" / "io_struct.py")
    api = read_request_types(wheel_source / "sglang" / "api" / "v1" / "api_types.py")
    return routes, types, api["SamplingParams"]


def problems_with(path: str, method: str, body, contract) -> list[str]:
    """What is wrong with sending `body` to `method path` of the wheel's server."""
    routes, types, sampling = contract
    route = routes.get(path)
    if route is None:
        return [f"{method} {path}: the wheel has no such route"]
    if method not in route.methods:
        return [f"{method} {path}: the wheel serves it for {sorted(route.methods)} only"]
    if route.request_type is None or route.request_type not in types:
        return [] if not body else [f"{path}: the wheel takes no body, the project sends {body}"]
    declared = types[route.request_type]
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


# ------------------------------------------------------------------------------ the project's calls
def _recorded_calls(tmp_path: Path) -> list[tuple[str, dict | None]]:
    """Every request the client sends in generation, a disk refit of the weights the servers
    started with (snapshot, reset, compare) and a broadcast refit (read back, checksums), as two
    stand-ins saw them."""
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
    finally:
        for server in servers:
            server.close()
    checked = [body["action"] for path, body in standins[0][1].requests if path == ROUTE]
    assert checked == ["snapshot", "compare", "snapshot", "reset_tensors", "compare", "checksum"]
    return [call for _, state in standins for call in state.requests]


def test_the_project_calls_only_what_the_pinned_wheel_serves(contract, tmp_path):
    calls = _recorded_calls(tmp_path)
    found = [
        problem for path, body in calls for problem in problems_with(path, "POST", body, contract)
    ]
    # The servers' start-up health poll (SGLangServerProcess.wait_healthy), a GET without body.
    found += problems_with("/health_generate", "GET", None, contract)
    assert not found, f"against sglang=={sglang_pin()}:\n" + "\n".join(found)
    called = {path for path, _ in calls} | {"/health_generate"}
    routes, _, _ = contract
    for module in CLIENT_MODULES:
        text = (ROOT / "gymrl" / "generation" / module).read_text()
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"/[a-z_]+", node.value)
            ):
                assert node.value in routes, f"{module} calls {node.value}: not in the wheel"
                assert node.value in called, f"{module} calls {node.value}: not exercised"


def test_a_field_the_wheel_does_not_declare_is_caught(contract):
    """The checker itself: misspelt, extra and missing fields are reported."""
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


def test_the_standin_serves_the_wheels_routes_with_its_request_types(contract):
    routes, types, sampling = contract
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
        if model is None or route.request_type not in types:
            continue
        declared = types[route.request_type]
        own = {name for name, info in model.model_fields.items()}
        required = {name for name, info in model.model_fields.items() if info.is_required()}
        found += [
            f"{path}: the stand-in accepts {name!r}, {route.request_type} has no such field"
            for name in sorted(own - declared.fields)
        ]
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
    assert not found, f"against sglang=={sglang_pin()}:\n" + "\n".join(found)


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
    policy = PolicyConfig(
        name="m",
        source="pretrained",
        path="/m",
        max_total_sequence_length=65536,
        native_context_length=32768,
        yarn={"factor": 2.0, "original_max_position_embeddings": 32768},
    )
    command = server_command(generation, policy, model_path="/m", port=1, seed=0)
    flags = [word.split("=")[0] for word in command if word.startswith("--")]
    assert "--json-model-override-args" in flags and "--enable-deterministic-inference" in flags
    unknown = [flag for flag in flags if flag[2:].replace("-", "_") not in fields]
    assert unknown == [], f"flags SGLang {sglang_pin()} does not take: {unknown}"
