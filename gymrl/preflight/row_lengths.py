"""Prompt lengths of a run's Gym rows against the context, for the dry-run plan.

A row whose prompt (its input items and tools, rendered with the policy's chat template) leaves
less than one turn (`generation.server.max_tokens_per_turn`) of the context cannot be played out:
in a run the policy server refuses the prompt or cuts the turn at the context's end. The dry run
names such rows before anything starts, with the longest prompt and what is left to act in, so a
user adding an environment sees whether its rows fit the model at all. The rendering is the
policy server's for a first turn: Gym's `vllm_model` adapter sends the same messages (its own
conversion of the row's Responses items), so the count is the one the server will make, give or
take the adapter's rendering of items the recipe's conversion treats alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gymrl.generation.server.chat_template import ChatFormat, row_prompt_token_count
from nemo_gym_ext.wire import Row


@dataclass(frozen=True)
class RowLengths:
    """Prompt tokens of one JSONL file's rows; `too_long` holds (line, tokens) of every row whose
    prompt plus one turn exceeds the context; `unreadable` (line, reason) of rows that do not
    render."""

    path: str
    rows: int = 0
    longest: int = 0
    longest_line: int = 0
    too_long: list[tuple[int, int]] = field(default_factory=list)
    unreadable: list[tuple[int, str]] = field(default_factory=list)

    def describe(self, context: int, turn_tokens: int) -> str:
        if not self.rows:
            return f"{self.path}: no rows"
        text = (
            f"{self.path}: {self.rows} rows, longest prompt {self.longest} tokens (line "
            f"{self.longest_line}) of context {context}, {context - self.longest} left to act"
        )
        if self.too_long:
            lines = ", ".join(f"line {line} ({tokens})" for line, tokens in self.too_long[:5])
            more = f" and {len(self.too_long) - 5} more" if len(self.too_long) > 5 else ""
            text += (
                f"; {len(self.too_long)} leave less than one turn ({turn_tokens} tokens) of the "
                f"context: {lines}{more}"
            )
        if self.unreadable:
            line, reason = self.unreadable[0]
            text += f"; {len(self.unreadable)} do not render, first line {line}: {reason}"
        return text


def measure_rows(
    path: str, chat_format: ChatFormat, *, context: int, turn_tokens: int
) -> RowLengths:
    """Every row of the JSONL file at `path`, rendered and counted (blank lines skipped)."""
    longest = longest_line = rows = 0
    too_long: list[tuple[int, int]] = []
    unreadable: list[tuple[int, str]] = []
    with Path(path).open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            rows += 1
            try:
                row = json.loads(line)
                Row.model_validate(row)  # what Gym would refuse, named as such
                tokens = row_prompt_token_count(row, chat_format)
            except ValueError as error:  # bad JSON, a row Gym would refuse, a template error
                unreadable.append((number, f"{type(error).__name__}: {str(error)[:200]}"))
                continue
            if tokens > longest:
                longest, longest_line = tokens, number
            if tokens + turn_tokens > context:
                too_long.append((number, tokens))
    return RowLengths(path, rows, longest, longest_line, too_long, unreadable)
