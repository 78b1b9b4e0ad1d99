"""The TRL side of benchmarks/bench_vs_trl.py; runs inside the TRL virtual environment.

    .venv-trl/bin/python benchmarks/trl_worker.py SPEC.json OUT.json [--check-prompts]
    .venv-trl/bin/python benchmarks/trl_worker.py SPEC.json OUT.json --validation-only

`bench_vs_trl.py` writes SPEC.json from the project's composed config (rows, template, tool
schema, settings); this script never reads the project's config itself, so the TRL venv needs no
Hydra. It imports only the calculator's tool and verifier code from the repository
(`nemo_gym_ext.envs.calculator`, `nemo_gym_ext.envs.tools`), so both sides score and answer tool
calls with the same functions.

TRL's documented tool-calling path is used as a user would: `GRPOTrainer(..., tools=[calculator])`,
which runs its own multi-turn loop (generate, parse the tool call, call the function, append the
tool message's template suffix, generate again) with transformers' `generate`. Three things are
set on the tokenizer so that TRL renders and parses exactly what the project does:

* `chat_template` is the project's `smollm2_tools` template (SmolLM2's own renders no tools);
* `response_template` is TRL's Hermes parser (`<tool_call>{json}</tool_call>`, the format the
  template asks for; TRL ships it for Qwen, and `add_response_schema` does not know this template);
* `apply_chat_template` is wrapped so that the tool function is rendered with the row's JSON
  schema: transformers would derive a schema from the function's signature and docstring, whose
  key order and missing `additionalProperties` change the system prompt's tokens.

With `--check-prompts` it only builds the trainer and writes the prompt ids TRL would generate
from (first turn, and after a tool output), for the bench to compare with the project's. With
`--validation-only` it runs one validation pass and stops (for `bench_rollout_timeline.py
--held-out`'s comparison). Every validation pass records each forward pass of the model (rows,
new positions, seconds).

Timing comes from a subclass that times `_generate_and_score_completions` (one call per
optimizer step here: the whole generation batch, tools and rewards included) and a callback that
times each optimizer step; train time is the step's time minus its rollout. Each step also keeps
its batch's mean reward (what TRL logs as `reward`), for the learning curve per step.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("spec", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--check-prompts", action="store_true")
    parser.add_argument(
        "--validation-only",
        action="store_true",
        help="one validation pass with the step-0 weights, no training (what a pass waits on)",
    )
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a slow run is
    spec = json.loads(args.spec.read_text())
    sys.path.insert(0, spec["repo_root"])  # the calculator's tool and verifier code

    import torch

    torch.set_num_threads(spec["settings"]["threads"])
    if args.check_prompts:
        trainer = build_trainer(spec, output_dir=args.out.parent / "trl_check")
        args.out.write_text(json.dumps(prompt_ids(trainer, spec["check"])))
        return
    started = time.monotonic()
    trainer = build_trainer(spec, output_dir=args.out.parent / "trl_run")
    setup_s = time.monotonic() - started
    print(f"[trl] trainer built in {setup_s:.1f} s", flush=True)
    validation = [validate(trainer, "start")]
    if args.validation_only:
        args.out.write_text(json.dumps({"validation": validation, "versions": versions()}))
        return
    trainer.train()
    validation.append(validate(trainer, "end"))
    result = {
        "setup_s": setup_s,
        "steps": trainer.step_records,
        "validation": validation,
        # TRL's own per-step logs (clip ratios, completion lengths, tool calls), for diagnosis.
        "log_history": trainer.state.log_history,
        "versions": versions(),
    }
    args.out.write_text(json.dumps(result, indent=1))


def versions() -> dict[str, str]:
    import torch
    import transformers
    import trl

    return {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def build_trainer(spec: dict[str, Any], output_dir: Path):
    """A GRPOTrainer with the project's settings, template, tool and verifier."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from nemo_gym_ext.envs.calculator import CALCULATOR, CalculatorArguments, CalculatorState

    settings = spec["settings"]
    tool_schemas = {schema["function"]["name"]: schema for schema in spec["tool_schemas"]}
    calculator_tool = next(tool for tool in CALCULATOR.tools if tool.name == "calculator")

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: Arithmetic expression with numbers, + - * / // % ** and parentheses.
        """
        # The project's tool function; its state is unused by the calculator.
        return calculator_tool.call(
            CalculatorState(expected_answer=0), CalculatorArguments(expression=expression)
        ).output

    def reward(completions, expected_answer, **_: Any) -> list[float]:
        """The project's verifier on the episode, rebuilt as the Responses items it reads."""
        return [
            float(
                CALCULATOR.verify(
                    CalculatorState(expected_answer=int(expected)), to_items(messages)
                )["reward"]
            )
            for messages, expected in zip(completions, expected_answer, strict=True)
        ]

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.chat_template = spec["chat_template"]
    tokenizer.response_template = qwen3_template
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    own_apply = tokenizer.apply_chat_template

    def apply_with_row_schemas(*args: Any, tools: Any = None, **kwargs: Any):
        if tools:
            tools = [tool_schemas[t.__name__] if callable(t) else t for t in tools]
        return own_apply(*args, tools=tools, **kwargs)

    tokenizer.apply_chat_template = apply_with_row_schemas

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    groups, generations = settings["groups"], settings["generations"]
    micro = settings["micro_batch_size"]
    per_step = groups * generations
    config = GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=settings["bf16"],  # the project's policy.compute_dtype, resolved for this CPU
        seed=settings["seed"],
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=settings["weight_decay"],
        adam_beta1=settings["betas"][0],
        adam_beta2=settings["betas"][1],
        adam_epsilon=settings["eps"],
        max_grad_norm=settings["max_grad_norm"],
        max_steps=settings["steps"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=generations,
        num_generations_eval=1,
        per_device_eval_batch_size=settings["val_batch_size"],
        shuffle_dataset=False,
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=0,
        # TRL's max_completion_length bounds the whole episode (all turns and tool outputs);
        # the per-turn limit is generate's max_new_tokens.
        max_completion_length=settings["episode_token_budget"],
        generation_kwargs={"max_new_tokens": settings["max_tokens_per_turn"]},
        max_tool_calling_iterations=settings["max_model_calls"] - 1,
        beta=settings["beta"],
        epsilon=settings["clip_low"],
        epsilon_high=settings["clip_high"],
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL defaults to True; the project's trainer has none
    )

    train = Dataset.from_list(
        [
            {"prompt": trl_messages(row["messages"]), "expected_answer": row["expected_answer"]}
            for row in spec["train_rows"]
        ]
    )
    held_out = Dataset.from_list(
        [
            {"prompt": trl_messages(row["messages"]), "expected_answer": row["expected_answer"]}
            for row in spec["val_rows"]
        ]
    )

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that records each generation batch's wall time and token counts."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.rollouts: list[dict[str, float]] = []
            self.step_records: list[dict[str, float]] = []

        def _generate_and_score_completions(self, inputs):
            started = time.monotonic()
            output = super()._generate_and_score_completions(inputs)
            mask = output["completion_mask"]
            if "tool_mask" in output:
                mask = mask * output["tool_mask"]
            mode = "train" if self.model.training else "eval"
            self.rollouts.append(
                {
                    "training": float(self.model.training),
                    # The batch's mean reward, as the parent just logged it.
                    "reward": self._metrics[mode]["reward"][-1],
                    "rollout_s": time.monotonic() - started,
                    "episodes": float(mask.shape[0]),
                    "generated_tokens": float(mask.sum().item()),
                    "trainer_tokens": float(
                        output["prompt_mask"].sum().item() + output["completion_mask"].sum().item()
                    ),
                }
            )
            return output

    class StepTimer(TrainerCallback):
        """Wall time of every optimizer step, with that step's rollout."""

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.monotonic()
            self.seen = len(trainer.rollouts)

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.monotonic() - self.started
            mine = [r for r in trainer.rollouts[self.seen :] if r["training"]]
            rollout_s = sum(r["rollout_s"] for r in mine)
            record = {
                "step": state.global_step,
                "step_s": step_s,
                "rollout_s": rollout_s,
                "train_s": step_s - rollout_s,
                "episodes": sum(r["episodes"] for r in mine),
                "reward": sum(r["reward"] * r["episodes"] for r in mine)
                / max(sum(r["episodes"] for r in mine), 1.0),
                "generated_tokens": sum(r["generated_tokens"] for r in mine),
                "trainer_tokens": sum(r["trainer_tokens"] for r in mine),
            }
            trainer.step_records.append(record)
            print(
                f"[trl] step {state.global_step}/{args.max_steps}: {step_s:.1f} s "
                f"(rollout {rollout_s:.1f} s), {record['generated_tokens']:.0f} generated tokens, "
                f"reward {record['reward']:.3f}",
                flush=True,
            )

    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer,
        tools=[calculator],
        callbacks=[StepTimer()],
    )
    return trainer


def validate(trainer, when: str) -> dict[str, Any]:
    """One greedy episode per held-out row, the work of the project's validation, through TRL's
    own generation path: `_generate` (its batched `generate` and tool loop, as a training step
    runs it, in eval mode so one generation per prompt), then the reward function.

    Not `trainer.evaluate()`: that also runs, for every batch, the rest of
    `_generate_and_score_completions` and the loss's forward pass, which the project's
    validation does not. The held-out rows go in batches of `per_device_eval_batch_size`, as
    `evaluate()` would batch them; the tool table is set per batch as
    `_generate_and_score_completions` sets it (one per rollout, the standalone tools)."""
    rows = trainer.eval_dataset
    batch_size = trainer.args.per_device_eval_batch_size
    reward_function = trainer.reward_funcs[0]
    generation = trainer.generation_config
    sampled, training = generation.do_sample, trainer.model.training
    generation.do_sample = False  # greedy, as the project's grpo.val_temperature=0
    trainer.model.eval()
    rewards: list[float] = []
    generated = 0
    forwards = ForwardCounter(trainer.model)
    started = time.monotonic()
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            prompts = batch["prompt"]
            trainer._sync_tool_dicts = [{t.__name__: t for t in trainer._standalone_tools}] * len(
                prompts
            )
            trainer._async_tool_dicts = [{} for _ in prompts]
            _, _, tool_mask, completions, *_ = trainer._generate(prompts)
            rewards += reward_function(completions, batch["expected_answer"])
            generated += sum(sum(mask) for mask in tool_mask)
    finally:
        forwards.remove()
        generation.do_sample = sampled
        trainer.model.train(training)
        trainer._metrics["eval"].clear()  # `_generate`'s logging, never written
    wall_s = time.monotonic() - started
    reward = sum(rewards) / len(rewards)
    print(
        f"[trl] validation at the {when}: reward {reward:.3f}, {wall_s:.1f} s, "
        f"{generated} generated tokens, {forwards.summary()}",
        flush=True,
    )
    return {
        "when": when,
        "wall_s": wall_s,
        "reward": reward,
        "generated_tokens": generated,
        "forwards": forwards.records,
    }


class ForwardCounter:
    """Every forward pass of `model` while it is attached: its rows, its new positions (1 in a
    decode step, the prompt's length in `generate`'s prefill) and its seconds. `generate` runs
    all the rows of a batch in lockstep, finished ones included, so each forward reads every
    weight once whatever its rows: on memory that limits the step, forwards are the pass's
    cost (benchmarks/README.md, issue 42)."""

    def __init__(self, model) -> None:
        self.records: list[dict[str, float]] = []
        self._started = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, _module, _args, kwargs) -> None:
        self._started = time.monotonic()

    def _after(self, _module, _args, kwargs, _output) -> None:
        rows, positions = kwargs["input_ids"].shape
        self.records.append(
            {"rows": rows, "positions": positions, "seconds": time.monotonic() - self._started}
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def summary(self) -> str:
        decode = [r for r in self.records if r["positions"] == 1]
        rows = sum(r["rows"] for r in decode) / max(len(decode), 1)
        return (
            f"{len(self.records)} forwards ({len(self.records) - len(decode)} prefills, "
            f"{len(decode)} decode steps of {rows:.1f} rows, "
            f"{sum(r['seconds'] for r in decode):.1f} s in decode steps)"
        )


def trl_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as TRL keeps them: string content, tool-call arguments as a mapping, tool
    messages named by their tool."""
    names = {}
    converted = []
    for message in messages:
        out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": json.loads(call["function"]["arguments"]),
                    },
                }
                for call in message["tool_calls"]
            ]
            names.update({c["id"]: c["function"]["name"] for c in message["tool_calls"]})
        if message["role"] == "tool":
            out["name"] = names.get(message.get("tool_call_id"), "")
        converted.append(out)
    return converted


def to_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's completion messages as the Responses items the project's verifier reads."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "assistant":
            text = message.get("content") or ""
            calls = message.get("tool_calls") or []
            if text or not calls:
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": text}],
                    }
                )
            for call in calls:
                function = call.get("function", {})
                items.append(
                    {
                        "type": "function_call",
                        "call_id": "",
                        "name": function.get("name", ""),
                        "arguments": json.dumps(function.get("arguments", {})),
                    }
                )
        elif message.get("role") == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": "",
                    "output": str(message.get("content")),
                }
            )
    return items


def prompt_ids(trainer, check: dict[str, Any]) -> dict[str, list[int]]:
    """The ids TRL generates from: the first turn as its batch rendering writes it, and after
    a tool output as its tool loop builds it (earlier ids + the tool message's suffix)."""
    tokenizer = trainer.processing_class
    first = tokenizer.apply_chat_template(
        conversation=[trl_messages(check["messages"])],
        tools=trainer.tools or None,
        chat_template=trainer.chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **trainer.chat_template_kwargs,
    )["input_ids"][0]
    tool_message = {"role": "tool", "name": check["tool_name"], "content": check["tool_output"]}
    # TRL's own suffix of a tool message (the template's rendering after the assistant turn).
    suffix = trainer._get_tool_suffix_ids([tool_message])
    return {
        "first_turn": list(first),
        "after_tool": list(first) + check["generation_ids"] + list(suffix),
    }


if __name__ == "__main__":
    main()
