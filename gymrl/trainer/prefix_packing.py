"""Shared-prefix ("trie") packing: sequences that start alike are computed once up to where they
part.

A GRPO step's episodes share long prefixes: every row of an environment starts with the same
system prompt and tool schema, and the episodes of a group also share the row's question. In the
embedded calculator task ~364 of an episode's ~450 tokens are such a prefix, so padding the
sequences side by side computes the same prompt sixteen times. Causal attention makes the hidden
state of a token depend only on the tokens before it, so sequences can be merged into a prefix
tree: every distinct prefix becomes one node, laid out once in one packed sequence, where each
node attends to exactly its ancestors and itself and sits at its depth as position id. Each
sequence's hidden states are then the ones of the nodes along its path, and a loss on several
sequences backpropagates into a shared node once, with the sum of their gradients.

Nodes are numbered in depth-first (pre-order) order, which the lexicographic order of the
sequences produces directly: each sequence shares with the one before it exactly their longest
common prefix and adds its remaining tokens as new nodes. In that numbering a node's subtree is
the contiguous range `[node, subtree_end[node])`, so "j is an ancestor of i" is two comparisons
and the `[N, N]` mask is built without walking the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class PrefixTree:
    """Sequences packed as a prefix tree of `N` nodes, numbered depth first.

    `token_ids`, `positions` and `subtree_end` are `[N]`: each node's token, its depth (the
    position of that token in every sequence through it) and one past the last node of its
    subtree. `token_index` is `[B, T]`: the node of token `t` of sequence `b`, in the order the
    sequences were given, `T` the longest sequence (as in `gymrl.algo.trajectory.collate`);
    entries past a sequence's end, where collate pads, are 0 and mean nothing.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    subtree_end: torch.Tensor
    token_index: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def is_chain(self) -> bool:
        """Whether the tree is one path (one sequence, or sequences each a prefix of the next):
        every node at its index as its depth. Then plain causal attention is its mask, and the
        `[N, N]` one need not be built: a sequence longer than a micro-batch's budget is packed
        alone, so this is what bounds the memory of long episodes."""
        return bool(
            torch.equal(self.positions, torch.arange(self.num_nodes, device=self.positions.device))
        )

    def visible(self) -> torch.Tensor:
        """`[N, N]` booleans: node i may attend to node j iff j is i or one of its ancestors."""
        nodes = torch.arange(self.num_nodes, device=self.subtree_end.device)
        return (nodes[None, :] <= nodes[:, None]) & (nodes[:, None] < self.subtree_end[None, :])

    def to(self, device: torch.device) -> PrefixTree:
        return PrefixTree(
            **{
                field.name: getattr(self, field.name).to(device, non_blocking=True)
                for field in fields(self)
            }
        )


def pack_prefix_tree(sequences: Sequence[Sequence[int]]) -> PrefixTree:
    """The prefix tree of `sequences` (each non-empty); identical sequences share every node."""
    if not sequences or any(not sequence for sequence in sequences):
        raise ValueError(
            f"pack_prefix_tree needs non-empty sequences; got {len(sequences)} sequence(s) with "
            f"lengths {[len(sequence) for sequence in sequences]}"
        )
    order = _lexicographic(sequences)
    token_ids: list[int] = []
    positions: list[int] = []
    subtree_end: list[int] = []
    token_index = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    path: list[int] = []  # the nodes of the previous sequence in lexicographic order
    previous: Sequence[int] = ()
    for row in order:
        sequence = sequences[row]
        shared = _common_prefix_length(previous, sequence)
        for node in path[shared:]:  # the previous sequence's branch ends here
            subtree_end[node] = len(token_ids)
        path = path[:shared]
        for depth in range(shared, len(sequence)):
            path.append(len(token_ids))
            token_ids.append(sequence[depth])
            positions.append(depth)
            subtree_end.append(-1)  # set when the last sequence through the node has passed
        token_index[row, : len(sequence)] = torch.tensor(path)
        previous = sequence
    for node in path:
        subtree_end[node] = len(token_ids)
    return PrefixTree(
        token_ids=torch.tensor(token_ids),
        positions=torch.tensor(positions),
        subtree_end=torch.tensor(subtree_end),
        token_index=token_index,
    )


def prefix_chunks(sequences: Sequence[Sequence[int]], max_nodes: int) -> list[list[int]]:
    """Indices into `sequences`, in lexicographic order (sequences that share a prefix side by
    side), cut into consecutive chunks whose prefix trees have at most `max_nodes` nodes; a
    sequence longer than that forms a chunk of its own."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    chunks: list[list[int]] = []
    nodes = 0
    previous: Sequence[int] = ()
    for row in _lexicographic(sequences):
        sequence = sequences[row]
        added = len(sequence) - _common_prefix_length(previous, sequence)
        if chunks and nodes + added <= max_nodes:
            chunks[-1].append(row)
            nodes += added
        else:
            chunks.append([row])
            nodes = len(sequence)
        previous = sequence
    return chunks


def _common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens `first` and `second` have in common."""
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


def _lexicographic(sequences: Sequence[Sequence[int]]) -> list[int]:
    return sorted(range(len(sequences)), key=lambda row: list(sequences[row]))
