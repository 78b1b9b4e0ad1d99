"""Merge a LoRA run's adapter into its base policy and write a Hugging Face folder.

    python -m gymrl.recipes.merge_adapter CHECKPOINT OUTPUT [OVERRIDES ...]

CHECKPOINT is what `eval.checkpoint` takes (one `step_<n>` folder, a run's `checkpoints/` or the
run folder: the newest checkpoint that passes its manifest); OVERRIDES are the Hydra overrides
the run trained with (`+experiment=learn run.seed=0`), which name the base policy the adapter was
trained on (a tiny random Llama is rebuilt from `run.seed`). PEFT itself merges
(`PeftModel.merge_and_unload`), the path every PEFT user's tools take; the folder holds the
merged weights, the model's config and the tokenizer, and loads anywhere a Hugging Face model
does (`policy.source=pretrained policy.path=OUTPUT`, SGLang's `--model-path`, transformers).
OUTPUT must not exist; it appears whole or not at all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config
from gymrl.run.eval_checkpoint import choose_checkpoint


def merge_adapter(checkpoint: str, output: Path, overrides: list[str]) -> Path:
    """Write the merged model of `checkpoint`'s adapter on the base policy `overrides` compose
    into `output`; returns the checkpoint folder that was merged."""
    from peft import PeftModel

    from gymrl.model.policy import build_policy
    from gymrl.run.atomic import atomic_folder

    if output.exists():
        raise FileExistsError(f"{output} exists; name a new folder for the merged model")
    chosen, rejected = choose_checkpoint(checkpoint)
    for problem in rejected:
        print(f"skipping a damaged checkpoint: {problem}", file=sys.stderr)
    if not chosen.holds_adapter:
        raise ValueError(
            f"{chosen.folder} holds every weight, not a LoRA adapter: it is a full model already "
            "(evaluate it with eval.checkpoint, or load its model.safetensors)"
        )
    config = validate_config(compose_raw(overrides))
    model, tokenizer = build_policy(config.policy, config.run.seed)
    merged = PeftModel.from_pretrained(model, str(chosen.folder)).merge_and_unload()
    with atomic_folder(output, durable=True) as staging:
        merged.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return chosen.folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gymrl.recipes.merge_adapter",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("checkpoint", help="a step_<n> folder, a checkpoints/ folder or a run")
    parser.add_argument("output", type=Path, help="the Hugging Face folder to write (new)")
    parser.add_argument(
        "overrides", nargs="*", help="the run's Hydra overrides (+experiment=..., run.seed=...)"
    )
    args = parser.parse_args(argv)
    try:
        folder = merge_adapter(args.checkpoint, args.output, args.overrides)
    except (ValueError, FileExistsError) as error:  # refusals, with what to do instead
        print(f"merge refused: {error}", file=sys.stderr)
        return 2
    print(f"merged {folder} into {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
