"""How a config is refused: every problem found, each with its key, its value, what is wrong and
the fix. Shared by the Gym-side config (`nemo_gym_ext.config`) and the recipe's validator
(`gymrl.preflight.validate`), which reports both in one error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a composed config: where, what was there, what is wrong, how to fix it."""

    key: str
    value: Any
    problem: str
    fix: str

    def render(self) -> str:
        value = _short_repr(self.value)
        return f"{self.key} = {value}: {self.problem}\n    fix: {self.fix}"


class ConfigError(ValueError):
    """A config that cannot run. Carries every issue found, not just the first."""

    def __init__(self, issues: list[ConfigIssue]):
        self.issues = list(issues)
        noun = "problem" if len(self.issues) == 1 else "problems"
        body = "\n".join(f"  - {issue.render()}" for issue in self.issues)
        super().__init__(f"invalid config ({len(self.issues)} {noun}):\n{body}")


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
