"""Evaluate a policy on held-out rows, per agent, with k samples each: `recipes/eval.py`.

The roles a training run starts, minus the trainer: the generation server (every engine the
config places: one torch engine here, one or many SGLang engines on a cluster) with its policy
server, then the Gym shards of `env.source` (built-in, launched or joined). A checkpoint's
weights reach the engines as a training refit does (`update_weights`, or a LoRA run's adapter
`update_adapter`, version = its step). The
pass is training validation's own (`gymrl.experience.held_out.Validator`), `eval.num_samples`
episodes per row at `eval.temperature`, reduced by the same function under `eval/`, plus pass@k
(`gymrl.experience.pass_at_k`), failure rates and the token ledger.

What can be checked before a model loads is: the checkpoint (complete, passes its manifest,
holds torch weights), the eval folder (not another eval's), the Gym venv, and with built-in
environments the rows' agents. With a Gym deployment its agents are known once it is up; rows
naming others are refused then, before any episode runs.

Every episode is appended to `<eval folder>/episodes.jsonl` as it ends; `summary.json` is written
at the end, also after SIGINT/SIGTERM, which stop the pass (episodes still running are
cancelled) and leave `complete: false` in the summary; the status is then 128 + the signal.
"""

from __future__ import annotations

import logging
import math
import secrets
import signal
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from gymrl.cluster.ray_calls import wait_for
from gymrl.cluster.session import ClusterSession
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.experience.held_out import (
    HeldOutEpisode,
    HeldOutPass,
    Validator,
    held_out_metrics,
    ledger_metrics,
)
from gymrl.experience.pass_at_k import pass_at_k_metrics
from gymrl.experience.rows import load_rows, load_validation_rows
from gymrl.generation.server.api_key import resolve_api_key
from gymrl.model.policy import model_folder
from gymrl.recipes.stopping_errors import RUN_STOPPING_ERRORS
from gymrl.roles.generation_server import start_generation_server
from gymrl.roles.gym_shard import RayGroupRunner, start_gym_shards
from gymrl.run.eval_checkpoint import (
    CheckpointRefusedError,
    EvaluatedCheckpoint,
    checkpoint_adapter,
    checkpoint_weights,
    choose_checkpoint,
)
from gymrl.run.eval_folder import (
    EpisodeLog,
    EvalFolderInUseError,
    claim_eval_folder,
    write_summary,
)
from gymrl.tracking.metrics_logger import WandbSink
from nemo_gym_ext.gym_launch import gym_launcher

log = logging.getLogger(__name__)
PREFIX = "eval/"
START_LABEL = "start"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class EvalRecipe:
    """One evaluation in the order it happens: `setup()`, `evaluate()`, `cleanup()` (always, in
    a `finally`: it closes in reverse whatever setup started, also after a half-way failure)."""

    def __init__(self, config: RecipeConfig, run_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.cluster = ClusterSession()
        self.stop = threading.Event()
        self.stopped_by: int | None = None  # the signal that stopped the pass

    # --------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        config = self.config
        api_key = resolve_api_key(config.generation.server.api_key_file)
        self.checkpoint = self._checkpoint()
        self.folder = self._folder()
        if config.env.source == "gym_launch":
            gym_launcher(Path(config.env.gym.venv))  # a missing venv fails before anything starts
        self.rows: list[dict[str, Any]] | None = None
        if config.env.source == "builtin":  # every agent is in the config: check the rows now
            served = {name for actor in config.gym_shards for name in actor.agents}
            self.rows = self._held_out_rows(served)
        claim_eval_folder(self.folder)
        log.info(f"eval of {self.label}: writing {self.folder}")
        started = time.monotonic()
        # No handlers to put back: `run_eval` installs the eval's after setup, after ray.init.
        cluster = self.cluster
        cluster.start(config, with_trainer=False)
        generation = start_generation_server(
            config,
            output_dir=self.folder,
            torch_threads=2,  # nothing trains: generation takes both cores of a laptop
            placement=cluster.placement,
            group=cluster.group,
            api_key=api_key,
            on_cleanup=cluster.on_cleanup,
            episode_deadline_s=config.env.rollout.run_timeout_s,
        )
        if self.checkpoint is not None:
            actor = generation.actor
            load = (
                actor.update_adapter.remote(checkpoint_adapter(self.checkpoint), self.step)
                if self.checkpoint.holds_adapter
                else actor.update_weights.remote(checkpoint_weights(self.checkpoint), self.step)
            )
            version = wait_for(
                load,
                timeout_s=config.grpo.batch_timeout_s,  # a training refit's deadline
                what="loading the checkpoint's weights into the engines (grpo.batch_timeout_s)",
            )
            log.info(f"engines hold the weights of {self.checkpoint.folder} (version {version})")
        shards_by_agent = start_gym_shards(
            config,
            output_dir=self.folder,
            policy=generation.policy,
            model_folder=model_folder(config.policy),
            placement=cluster.placement,
            group=cluster.group,
            on_cleanup=cluster.on_cleanup,
        )
        if self.rows is None:
            self.rows = self._held_out_rows(shards_by_agent)
        log.info(
            f"{len(self.rows)} held-out rows x {config.eval.num_samples} samples on "
            f"{sorted(shards_by_agent)}, set up in {time.monotonic() - started:.1f} s"
        )
        self.validator = Validator(
            self.rows,
            RayGroupRunner(shards_by_agent, generation.raise_if_engine_failed),
            config.eval.timeout_s,
            max_refused_share=config.env.data.max_refused_held_out_share,
            num_samples=config.eval.num_samples,
            prefix=PREFIX,
            deadline_key="eval.timeout_s",
            keep_transcripts=config.eval.transcripts,
        )
        self.episode_log = EpisodeLog(self.folder)
        cluster.on_cleanup("the episode log", self.episode_log.close)

    @property
    def step(self) -> int:
        """The training step of the weights: the checkpoint's, 0 for the starting weights."""
        return 0 if self.checkpoint is None else self.checkpoint.step

    @property
    def label(self) -> str:
        return START_LABEL if self.checkpoint is None else self.checkpoint.label

    def _checkpoint(self) -> EvaluatedCheckpoint | None:
        if self.config.eval.checkpoint is None:
            return None
        checkpoint, rejected = choose_checkpoint(self.config.eval.checkpoint)
        generation = self.config.generation.backend
        if checkpoint.holds_adapter and generation != "torch":
            raise CheckpointRefusedError(
                f"eval.checkpoint={self.config.eval.checkpoint!r} holds a LoRA adapter, which "
                f"only the torch engine merges (generation={generation}); evaluate it with "
                "generation=torch, or merge it into a Hugging Face folder first "
                "(python -m gymrl.recipes.merge_adapter, docs/configuration.md 'LoRA') and "
                "evaluate that with policy.source=pretrained"
            )
        for problem in rejected:
            log.warning(f"skipping a damaged checkpoint: {problem}")
        return checkpoint

    def _folder(self) -> Path:
        chosen = self.config.eval.output_dir
        return Path(chosen).resolve() if chosen else self.run_dir / "eval" / self.label

    def _held_out_rows(self, served: Collection[str]) -> list[dict[str, Any]]:
        config = self.config
        data, sampling = config.env.data, config.generation.sampling
        # Training rows matter only to keep generated held-out tasks out of them.
        train_rows = (
            []
            if data.val_jsonl
            else load_rows(
                data,
                config.gym_shards,
                sampling,
                config.run.seed,
                served_agents=served,
                max_output_tokens=config.generation.server.max_tokens_per_turn,
            )
        )
        return load_validation_rows(
            data,
            config.gym_shards,
            train_rows,
            temperature=eval_temperature(config),
            top_p=sampling.top_p,
            served_agents=served,
        )

    # ------------------------------------------------------------------------------ evaluate
    def install_stop_signals(self) -> None:
        """SIGINT/SIGTERM end the pass with what finished (main thread; after `ray.init`)."""
        for signum in _STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopped_by = signum
        self.stop.set()
        print(
            f"{signal.Signals(signum).name}: stopping the eval, keeping what finished", flush=True
        )

    def evaluate(self) -> dict[str, Any]:
        """Run the pass, write and return the summary (`summary.json`)."""
        started = time.monotonic()
        held_out = self.validator.collect(self._record, stop=self.stop)
        summary = self.summary(held_out, wall_s=time.monotonic() - started)
        path = write_summary(self.folder, summary)
        print(render_summary(summary), flush=True)
        print(f"episodes: {self.folder / 'episodes.jsonl'}\nsummary: {path}", flush=True)
        if self.config.eval.wandb and self.config.logger.wandb.mode != "disabled":
            self._log_to_wandb(summary["metrics"])
        return summary

    def _record(self, episode: HeldOutEpisode) -> None:
        self.episode_log.write(episode.record())

    def summary(self, held_out: HeldOutPass, *, wall_s: float) -> dict[str, Any]:
        config, evaluation = self.config, self.config.eval
        metrics = eval_metrics(held_out, config)
        metrics[PREFIX + "wall_s"] = wall_s
        return {
            "policy": config.policy.name,
            "checkpoint": None if self.checkpoint is None else str(self.checkpoint.folder),
            "step": self.step,
            "label": self.label,
            "env_source": config.env.source,
            "rows": len(self.rows or []),
            "num_samples": evaluation.num_samples,
            "temperature": eval_temperature(config),
            "top_p": config.generation.sampling.top_p,
            "pass_at_k": sorted(set(evaluation.pass_at_k)),
            "success_threshold": evaluation.success_threshold,
            "complete": held_out.complete,
            "stopped_by": None if self.stopped_by is None else signal.Signals(self.stopped_by).name,
            "wall_s": wall_s,
            "metrics": metrics,
        }

    def _log_to_wandb(self, metrics: dict[str, float]) -> None:
        sink = WandbSink(
            self.config.logger,
            run_name=f"{self.config.run.name}-eval-{self.label}",
            output_dir=self.folder,
            hparams=self.config.model_dump(mode="json"),
            run_id=secrets.token_hex(8),
        )
        try:
            sink.log(self.step, metrics)
        finally:
            sink.close()

    # ------------------------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        """Close, in reverse order, whatever `setup` started; each closer best effort."""
        self.cluster.close()


def eval_temperature(config: RecipeConfig) -> float:
    """`eval.temperature`, or the policy's training temperature when it is null."""
    chosen = config.eval.temperature
    return config.generation.sampling.temperature if chosen is None else chosen


def eval_metrics(held_out: HeldOutPass, config: RecipeConfig) -> dict[str, float]:
    """The `eval/...` keys of docs/metrics.md: validation's reduction, the failure rates and
    token ledger, and pass@k at `eval.success_threshold`."""
    episodes = held_out.episodes
    metrics = held_out_metrics(held_out, prefix=PREFIX)
    metrics.update(ledger_metrics(episodes, prefix=PREFIX))
    metrics.update(
        pass_at_k_metrics(
            episodes,
            config.eval.pass_at_k,
            threshold=config.eval.success_threshold,
            prefix=PREFIX,
        )
    )
    return metrics


def render_summary(summary: dict[str, Any]) -> str:
    """A table a person reads: one line per agent."""
    metrics, ks = summary["metrics"], summary["pass_at_k"]
    agents = sorted(
        {k[len(PREFIX) :].split("/")[0] for k in metrics if k.endswith("/reward/stderr")}
    )
    head = ["episodes", "reward", "s.e.", *(f"pass@{k}" for k in ks)]
    head += ["failed", "truncated", "gen tokens"]
    width = max([len("agent"), *map(len, agents)])
    lines = [f"{'agent':<{width}}  " + "  ".join(f"{h:>10}" for h in head)]
    for agent in agents:
        at = f"{PREFIX}{agent}/"
        cells = [
            f"{metrics.get(at + 'episodes', math.nan):.0f}",
            _cell(metrics.get(at + "reward/mean")),
            _cell(metrics.get(at + "reward/stderr")),
            *(_cell(metrics.get(f"{at}pass@{k}")) for k in ks),
            _cell(metrics.get(at + "failure_rate")),
            _cell(metrics.get(at + "truncated/mean")),
            f"{metrics.get(at + 'tokens/generated', 0):.0f}",
        ]
        lines.append(f"{agent:<{width}}  " + "  ".join(f"{c:>10}" for c in cells))
    state = "complete" if summary["complete"] else f"stopped by {summary['stopped_by']}"
    title = (
        f"eval of {summary['label']} ({summary['policy']}), {summary['rows']} rows x "
        f"{summary['num_samples']} samples at temperature {summary['temperature']:g}, "
        f"success = reward >= {summary['success_threshold']:g}: {state}, "
        f"{summary['wall_s']:.0f} s"
    )
    return "\n".join([title, *lines])


def _cell(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


# Errors that end an eval with a message a user can act on (printed without a traceback).
EVAL_STOPPING_ERRORS = (
    *RUN_STOPPING_ERRORS,
    CheckpointRefusedError,
    EvalFolderInUseError,
    FileNotFoundError,  # env.data.val_jsonl
)


def run_eval(config: RecipeConfig, run_dir: Path) -> int:
    """Set up, evaluate and clean up; the process's exit status (0, 1 on a refused input or a
    failed pass, 128 + the signal when one stopped it, 130 for Ctrl-C during setup)."""
    recipe = EvalRecipe(config, run_dir)
    try:
        recipe.setup()
        recipe.install_stop_signals()  # after ray.init, which sets its own SIGTERM handler
        summary = recipe.evaluate()
    except KeyboardInterrupt:
        print("interrupted before the pass began: nothing was evaluated", file=sys.stderr)
        return 128 + signal.SIGINT
    except EVAL_STOPPING_ERRORS as error:
        print(f"eval stopped: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        recipe.cleanup()
    return 0 if summary["complete"] else 128 + (recipe.stopped_by or signal.SIGINT)
