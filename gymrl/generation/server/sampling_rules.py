"""Sampling parity: while a run trains, every request is sampled the way the trainer assumes.

The trainer recomputes each generated token's log-probability at the run's temperature
(`generation.sampling`) and compares it with the engine's. A request sampled at another
temperature or top-p is therefore off-policy without anyone saying so: its ratios are wrong from
the first token, and nothing in the loss can tell. Clients get there easily: a Gym agent that
forwards no sampling fields gets OpenAI's default of 1.0, and an agent with sampling settings of
its own overrides what the rows carry.

So while training, the policy server resolves each request's sampling here:

* a field the request leaves out (or sends as null) is the run's training value;
* a request at the run's training settings is sampled as asked, and so is one at validation's
  (whose episodes are never trained on) while a validation pass runs: the recipe opens that
  window around each pass (:meth:`SamplingParity.set_validating`). Between passes only
  training's episodes run, so a request at validation's settings is a training request sampled
  wrongly: a mismatch like any other. (Async GRPO keeps collecting training episodes during a
  pass; those are not told apart from validation's, a residue the window narrows but cannot
  close without tagging each request with its episode's kind.)
* any other request is a *mismatch*: with `override` (the default) it is sampled at the training
  settings, with `reject` it is refused with a 400 naming the field, the value and what the run
  samples at. Both are counted (:class:`SamplingCounts`) and logged per step.

The policy server of `recipes/serve.py` (a checkpoint served for Gym's own evaluation) and of the
eval recipe has no parity: it samples what each request asks for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from gymrl.config.schema.recipe import RecipeConfig

SamplingMismatch = Literal["override", "reject"]


@dataclass(frozen=True)
class Sampling:
    """One sampling setting: a temperature (0 = greedy) and a top-p mass."""

    temperature: float
    top_p: float

    @classmethod
    def of(cls, temperature: float, top_p: float) -> Sampling:
        """Greedy (temperature 0) with top-p 1 whatever was asked: top-p is moot then, so it
        cannot make two settings differ."""
        return cls(float(temperature), float(top_p) if temperature > 0 else 1.0)

    def describe(self) -> str:
        return f"temperature={self.temperature:g}, top_p={self.top_p:g}"


class SamplingMismatchError(ValueError):
    """A request asked for sampling the run does not train at, under `sampling_mismatch=reject`;
    `param` names the first field that differs."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingCounts:
    """Requests whose sampling differed from every setting of the run, since the server started:
    sampled at the training settings instead (`overridden`) or refused (`rejected`)."""

    overridden: int = 0
    rejected: int = 0


@dataclass(frozen=True)
class SamplingRules:
    """What a run samples at (`trained`; `held_out`: validation's, allowed during a pass only),
    and what to do with a request that asks otherwise: plain data, so it travels to the
    generation server's actor (`SamplingParity` holds the live counts and the pass window)."""

    trained: Sampling
    held_out: frozenset[Sampling]
    on_mismatch: SamplingMismatch

    def allowed(self, *, validating: bool) -> frozenset[Sampling]:
        return (self.held_out if validating else frozenset()) | {self.trained}


class SamplingParity:
    """Resolves a request's sampling against the run's (see the module docstring) and counts
    the mismatches; thread-safe."""

    def __init__(self, rules: SamplingRules):
        self.rules = rules
        self._lock = threading.Lock()
        self._counts = SamplingCounts()
        self._validating = False

    def set_validating(self, validating: bool) -> None:
        """Open (True) or close the window in which validation's sampling is allowed: the
        recipe opens it for the length of each validation pass."""
        with self._lock:
            self._validating = validating

    def resolve(self, temperature: float | None, top_p: float | None) -> Sampling:
        """The sampling to run a request at; `None` is a field the request left out."""
        trained = self.rules.trained
        asked = Sampling.of(
            trained.temperature if temperature is None else temperature,
            trained.top_p if top_p is None else top_p,
        )
        with self._lock:
            allowed = self.rules.allowed(validating=self._validating)
        if asked in allowed:
            return asked
        if self.rules.on_mismatch == "reject":
            self._count(rejected=1)
            param = "temperature" if asked.temperature != trained.temperature else "top_p"
            between_passes = (
                " (validation's settings, allowed only while a validation pass runs)"
                if asked in self.rules.held_out
                else ""
            )
            raise SamplingMismatchError(
                f"this run trains on episodes sampled at {trained.describe()}, and the "
                f"trainer recomputes log-probabilities at those settings; the request asks for "
                f"{asked.describe()}{between_passes}. Send the run's settings (or leave "
                "temperature and top_p out), or let the server apply them with "
                "generation.server.sampling_mismatch=override",
                param=param,
            )
        self._count(overridden=1)
        return trained

    def counts(self) -> SamplingCounts:
        with self._lock:
            return self._counts

    def _count(self, *, overridden: int = 0, rejected: int = 0) -> None:
        with self._lock:
            self._counts = SamplingCounts(
                self._counts.overridden + overridden, self._counts.rejected + rejected
            )


def training_sampling_rules(config: RecipeConfig) -> SamplingRules:
    """The GRPO recipe's: its training sampling, and validation's (during its passes) when the
    run validates."""
    sampling, grpo = config.generation.sampling, config.grpo
    validates = grpo.val_at_start or grpo.val_period > 0 or grpo.val_at_end
    held_out = {Sampling.of(grpo.val_temperature, sampling.top_p)} if validates else set()
    return SamplingRules(
        Sampling.of(sampling.temperature, sampling.top_p),
        held_out=frozenset(held_out),
        on_mismatch=config.generation.server.sampling_mismatch,
    )
