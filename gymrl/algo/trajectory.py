"""One episode as the trainer sees it, and the padded batch the policy model consumes.

The postprocessor (`nemo_gym_ext.postprocess.postprocess_gym_result`) hands over a `message_log`
that alternates prompt deltas (`{"role": "user", "token_ids"}`) and generations
(`{"role": "assistant", "token_ids", "generation_logprobs"}`). Because the episode is contiguous,
concatenating the entries gives exactly the token sequence the sampler conditioned each generation
on, so one forward pass over it recomputes every generated token's log-probability.

Alignment convention (used by :func:`collate` and by `gymrl.algo.loss.sequence_logprobs`): every
per-token tensor is indexed like `input_ids`. Position `t` describes token `t` itself: whether it
was generated (`loss_mask[t]`), the sampler's log-probability of it (`generation_logprobs[t]`),
and the trainer's log-probability of it, which the model predicts from the logits at position
`t - 1`. Position 0 therefore never carries a log-probability, and a trajectory must start with a
prompt token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nemo_gym_ext.postprocess import PostprocessedEpisode
from nemo_gym_ext.wire import agent_name_of


@dataclass(frozen=True)
class Trajectory:
    """A flattened episode: its tokens, which of them were generated, and how it was rewarded.

    A masked sample (the postprocessor's `on_malformed_result="mask"`) has no tokens: it trains on
    nothing but its reward still counts in its group's GRPO baseline. `weight_version` is the
    version of the weights that generated it (the oldest one, if a refit happened mid-episode);
    the replay buffer bounds staleness with it. `overlong`: some model call of the episode ended
    at its token limit (also when truncation dropped that call); `turn_lengths`: the generated
    tokens of each model call trained on; `longest_call_tokens`: the most tokens any model call
    of the whole episode generated (the prefix, its tail segments and a dropped tail alike:
    what the soft overlong penalty measures, so every trajectory of an episode carries it).
    `length_penalty` is what the episode rules (`gymrl.algo.episode_rules`) took off its reward for
    the GRPO advantage: `reward` stays the environment's. `segment` is 0 for an episode's own
    trajectory and k for its k-th tail segment (`split_noncontiguous_segments`): a segment
    follows its episode's trajectory, shares its advantage and stays out of the baseline.
    `call_ends`: one past each model call's last generated token in `token_ids` (the prefix up
    to it is that call's prompt and generation). `routed_experts` (router replay): the experts
    the generation engine routed each position to, `[tokens, layers, experts per token]`, with
    the type's largest value where none arrived (the trainer's live router decides those).
    """

    token_ids: list[int]
    loss_mask: list[int]
    generation_logprobs: list[float]
    reward: float
    agent: str
    group_id: str
    weight_version: int
    overlong: bool = False
    turn_lengths: tuple[int, ...] = ()
    longest_call_tokens: int = 0
    length_penalty: float = 0.0
    segment: int = 0
    call_ends: tuple[int, ...] = ()
    routed_experts: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        lengths = {len(self.token_ids), len(self.loss_mask), len(self.generation_logprobs)}
        if len(lengths) != 1:
            raise ValueError(
                f"trajectory of group {self.group_id!r}: token_ids ({len(self.token_ids)}), "
                f"loss_mask ({len(self.loss_mask)}) and generation_logprobs "
                f"({len(self.generation_logprobs)}) must have equal lengths"
            )
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError(
                f"trajectory of group {self.group_id!r} starts with a generated token; its "
                "log-probability cannot be recomputed (nothing precedes it). The first entry of "
                "message_log must be a non-empty prompt."
            )
        routes = self.routed_experts
        if routes is not None and (routes.ndim != 3 or len(routes) != len(self.token_ids)):
            raise ValueError(
                f"trajectory of group {self.group_id!r}: routed_experts of shape "
                f"{list(routes.shape)} must be [{len(self.token_ids)} tokens, layers, top-k]"
            )

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def training_reward(self) -> float:
        """The reward the GRPO advantage is computed from."""
        return self.reward - self.length_penalty

    def route_coverage(self) -> tuple[int, int]:
        """Router replay: `(received, expected)` positions: those with the engine's routes, of
        those that need them (every token but the last, whose output no loss reads)."""
        routes = self.routed_experts
        expected = max(len(self.token_ids) - 1, 0)
        if routes is None:
            return 0, expected
        missing = np.iinfo(routes.dtype).max
        return int((routes[:expected, 0, 0] != missing).sum()), expected

    @property
    def is_masked(self) -> bool:
        """True for a sample that contributes to its group's baseline but to no loss token."""
        return not self.token_ids

    @classmethod
    def from_postprocessed(
        cls, out: PostprocessedEpisode, *, group_id: str, weight_version: int
    ) -> Trajectory:
        """Flatten one `postprocess_gym_result` output.

        The reward and the agent are read from its result (`reward`, `agent_ref.name`); the
        postprocessor has already checked both (a finite number, a name), so they are not checked
        again here.
        """
        return cls._flattened(
            out, out.message_log, group_id=group_id, weight_version=weight_version, segment=0
        )

    @classmethod
    def segments_from_postprocessed(
        cls, out: PostprocessedEpisode, *, group_id: str, weight_version: int
    ) -> list[Trajectory]:
        """The tail segments split mode kept (`out.segments`), each a trajectory of its own with
        the episode's reward, agent and overlong flag."""
        return [
            cls._flattened(
                out, log, group_id=group_id, weight_version=weight_version, segment=index
            )
            for index, log in enumerate(out.segments or (), start=1)
        ]

    @classmethod
    def _flattened(
        cls,
        out: PostprocessedEpisode,
        message_log: Sequence[Mapping[str, Any]],
        *,
        group_id: str,
        weight_version: int,
        segment: int,
    ) -> Trajectory:
        agent = agent_name_of(out.result)
        token_ids: list[int] = []
        loss_mask: list[int] = []
        logprobs: list[float] = []
        turn_lengths: list[int] = []
        call_ends: list[int] = []
        for index, entry in enumerate(message_log):
            ids = entry["token_ids"]
            role = entry["role"]
            if role == "assistant":
                generated = entry["generation_logprobs"]
                if len(generated) != len(ids):
                    raise ValueError(
                        f"group {group_id!r}: message_log[{index}] has {len(ids)} token_ids but "
                        f"{len(generated)} generation_logprobs"
                    )
                logprobs.extend(generated)
                loss_mask.extend([1] * len(ids))
                turn_lengths.append(len(ids))
            elif role == "user":
                logprobs.extend([0.0] * len(ids))
                loss_mask.extend([0] * len(ids))
            else:
                raise ValueError(
                    f"group {group_id!r}: message_log[{index}].role is {role!r}; expected "
                    "'user' (prompt delta) or 'assistant' (generation)"
                )
            token_ids.extend(ids)
            if role == "assistant":
                call_ends.append(len(token_ids))
        return cls(
            token_ids=token_ids,
            loss_mask=loss_mask,
            generation_logprobs=[float(value) for value in logprobs],
            reward=float(out.result["reward"]),
            agent=agent,
            group_id=group_id,
            weight_version=weight_version,
            overlong=out.overlong,
            turn_lengths=tuple(turn_lengths),
            longest_call_tokens=out.longest_call_tokens,
            segment=segment,
            call_ends=tuple(call_ends),
        )


def collate(
    trajectories: Sequence[Trajectory],
    *,
    advantages: torch.Tensor,
    pad_token_id: int,
    max_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad trajectories into a batch: `input_ids`, `attention_mask`, `loss_mask`,
    `generation_logprobs` (all `[B, T]`, aligned as in the module docstring) and `advantages`
    (`[B]`).

    `advantages[i]` belongs to `trajectories[i]` (compute them with
    `gymrl.algo.advantages.grpo_advantages` over whole groups, masked samples included). Masked
    samples are left out of the batch: they have no token to train on, and an all-padding row
    would make attention normalise over nothing. `T` is the longest trajectory, or `max_length`
    when given (fixed shapes); a trajectory longer than `max_length` is an error rather than a
    silent cut, because cutting it would drop generated tokens the reward depends on.
    """
    if advantages.dim() != 1 or advantages.numel() != len(trajectories):
        raise ValueError(
            f"advantages must have shape [{len(trajectories)}] (one per trajectory), "
            f"got {list(advantages.shape)}"
        )
    kept = [i for i, trajectory in enumerate(trajectories) if not trajectory.is_masked]
    longest = max((len(trajectories[i].token_ids) for i in kept), default=0)
    if max_length is not None:
        if longest > max_length:
            worst = max(kept, key=lambda i: len(trajectories[i].token_ids))
            raise ValueError(
                f"trajectory of group {trajectories[worst].group_id!r} (agent "
                f"{trajectories[worst].agent!r}) has {longest} tokens, more than max_length="
                f"{max_length}; raise the trainer's max sequence length or lower the rollout's "
                "max_tokens/context limit so that episodes fit"
            )
        longest = max_length
    shape = (len(kept), longest)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.long)
    generation_logprobs = torch.zeros(shape, dtype=torch.float32)
    for row, index in enumerate(kept):
        trajectory = trajectories[index]
        length = len(trajectory.token_ids)
        input_ids[row, :length] = torch.tensor(trajectory.token_ids, dtype=torch.long)
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(trajectory.loss_mask, dtype=torch.long)
        generation_logprobs[row, :length] = torch.tensor(
            trajectory.generation_logprobs, dtype=torch.float32
        )
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "generation_logprobs": generation_logprobs,
        "advantages": advantages.detach().to(torch.float32)[kept],
    }
