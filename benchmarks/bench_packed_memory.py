"""Peak memory of one prefix-packed train step on a single long episode, with and without the
dense `[N, N]` attention mask.

An episode longer than `trainer.max_packed_tokens` is packed alone, so its prefix tree is one
path (`PrefixTree.is_chain`). The trainer then runs plain causal attention; before, it built the
tree's dense mask (a boolean `[N, N]` and an additive one in the compute dtype: about 5 bytes per
entry, 5 GB at 32k tokens) for every such episode. `--mask dense` forces that old path (the
chain test answers no), `--mask chain` is the trainer as it is.

The model is a tiny Llama (SmolLM2's vocabulary, hidden 64, 2 layers, 4 heads) so that the mask,
not the weights or the activations, is what the episode's length grows; the last 64 tokens are
the generated ones (the vocabulary projection runs only there). Each (mask, tokens) runs in its
own process, and the peak resident memory printed is that process's (`ru_maxrss`), with the
interpreter, torch and the model included (the `baseline` line: the same process at 256 tokens).

    python benchmarks/bench_packed_memory.py --tokens 8192 16384 32768 --mask chain dense
    python benchmarks/bench_packed_memory.py --tokens 32768 --mask chain   # dense needs ~6 GB more
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

GENERATED = 64
VOCAB = 49152


def one_step(tokens: int, mask: str) -> None:
    """One train step on one episode of `tokens` tokens; prints seconds and peak MiB."""
    import torch

    from gymrl.algo.trajectory import Trajectory
    from gymrl.config.schema.loss import LossConfig
    from gymrl.config.schema.trainer import TorchTrainerConfig
    from gymrl.model.loading import build_tiny_llama
    from gymrl.trainer.prefix_packing import PrefixTree
    from gymrl.trainer.torch_trainer import TorchPolicyTrainer

    torch.set_num_threads(1)
    model = build_tiny_llama(
        VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        seed=0,
        max_position_embeddings=tokens,
        tie_word_embeddings=False,  # an output layer of its own, as measured
    )
    model.set_attn_implementation("sdpa")
    torch.manual_seed(0)  # the episode's ids
    if mask == "dense":
        PrefixTree.is_chain = lambda self: False  # the trainer as it was: the mask, always
    trainer = TorchPolicyTrainer(
        model,
        TorchTrainerConfig(max_packed_tokens=1024),
        LossConfig(),
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype="float32",
    )
    ids = torch.randint(0, VOCAB, (tokens,)).tolist()
    loss_mask = [0] * (tokens - GENERATED) + [1] * GENERATED
    episode = Trajectory(ids, loss_mask, [-2.0 * m for m in loss_mask], 1.0, "bench", "g", 0)
    started = time.perf_counter()
    trainer.train_step([episode], torch.tensor([1.0]))
    seconds = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{seconds:.2f} {peak_mib:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Peak memory of a prefix-packed train step on one long episode."
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--mask", choices=["chain", "dense"], nargs="+", default=["chain"])
    parser.add_argument("--one", nargs=2, metavar=("TOKENS", "MASK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_step(int(args.one[0]), args.one[1])
        return
    print(f"{'mask':>8} {'tokens':>7} {'step s':>8} {'peak MiB':>9}")
    for mask in args.mask:
        for tokens in [256, *args.tokens]:
            done = subprocess.run(
                [sys.executable, __file__, "--one", str(tokens), mask],
                capture_output=True,
                text=True,
                check=True,
            )
            seconds, peak = done.stdout.split()
            label = "baseline" if tokens == 256 else str(tokens)
            print(f"{mask:>8} {label:>7} {seconds:>8} {peak:>9}", flush=True)


if __name__ == "__main__":
    main()
