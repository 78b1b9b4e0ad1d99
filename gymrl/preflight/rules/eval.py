"""Rules on `eval.*` (`gymrl.config.schema.eval`): pass@k needs k samples of every row, and
greedy samples of one row are all the same."""

from __future__ import annotations

from gymrl.config.schema.recipe import RecipeConfig
from nemo_gym_ext.config_errors import ConfigIssue


def pass_at_k_within_samples(config: RecipeConfig) -> list[ConfigIssue]:
    evaluation = config.eval
    too_large = sorted({k for k in evaluation.pass_at_k if k > evaluation.num_samples})
    if not too_large:
        return []
    return [
        ConfigIssue(
            "eval.num_samples",
            evaluation.num_samples,
            f"pass@k needs at least k episodes per row; eval.pass_at_k asks for k={too_large}",
            f"raise eval.num_samples to {too_large[-1]} or drop those k from eval.pass_at_k",
        )
    ]


def pass_at_k_positive(config: RecipeConfig) -> list[ConfigIssue]:
    not_positive = [k for k in config.eval.pass_at_k if k < 1]
    if not not_positive:
        return []
    return [
        ConfigIssue(
            "eval.pass_at_k",
            config.eval.pass_at_k,
            f"k must be 1 or more, not {not_positive}",
            "list positive k, e.g. eval.pass_at_k=[1,4]",
        )
    ]


def greedy_samples_differ(config: RecipeConfig) -> list[ConfigIssue]:
    """eval.temperature, else the run's sampling: greedy makes a row's samples one."""
    evaluation = config.eval
    temperature = (
        config.generation.sampling.temperature
        if evaluation.temperature is None
        else evaluation.temperature
    )
    if temperature != 0 or evaluation.num_samples <= 1:
        return []
    return [
        ConfigIssue(
            "eval.temperature",
            0,
            f"greedy decoding makes all eval.num_samples={evaluation.num_samples} episodes "
            "of a row the same",
            "sample (eval.temperature above 0), or set eval.num_samples=1 eval.pass_at_k=[1]",
        )
    ]
