"""Prefix-tree packing: each sequence reads back through its nodes, each node sees exactly its
ancestors, and shared prefixes are laid out once."""

import pytest
import torch

from gymrl.trainer.prefix_packing import pack_prefix_tree, prefix_chunks


def _check(sequences, tree):
    """Every sequence reads back from its path; each node's position is its depth; a node sees
    exactly the nodes on its path up to itself (brute force over every path)."""
    visible = tree.visible()
    expected = torch.zeros_like(visible)
    for row, sequence in enumerate(sequences):
        path = tree.token_index[row, : len(sequence)]
        assert tree.token_ids[path].tolist() == list(sequence)
        assert tree.positions[path].tolist() == list(range(len(sequence)))
        for depth, node in enumerate(path.tolist()):
            expected[node, path[: depth + 1]] = True
    assert torch.equal(visible, expected)


def test_identical_sequences_share_every_node():
    sequences = [[4, 5, 6], [4, 5, 6], [4, 5, 6]]
    tree = pack_prefix_tree(sequences)
    _check(sequences, tree)
    assert tree.num_nodes == 3
    assert torch.equal(tree.token_index, torch.tensor([[0, 1, 2]] * 3))


def test_a_prefix_of_another_sequence_is_its_first_nodes():
    sequences = [[4, 5, 6, 7, 8], [4, 5, 6]]
    tree = pack_prefix_tree(sequences)
    _check(sequences, tree)
    assert tree.num_nodes == 5
    assert tree.token_index[1].tolist() == [0, 1, 2, 0, 0]  # padded past its end with 0


def test_sequences_without_a_common_prefix_are_laid_side_by_side():
    sequences = [[9, 1, 2], [3, 4], [5]]
    tree = pack_prefix_tree(sequences)
    _check(sequences, tree)
    assert tree.num_nodes == 6
    assert tree.positions.tolist() == [0, 1, 0, 0, 1, 2]  # lexicographic: [3, 4], [5], [9, 1, 2]
    # Side by side, nothing crosses between them: a block-diagonal causal mask.
    visible = tree.visible()
    assert not visible[2, :2].any() and not visible[3:, :3].any()


def test_groups_sharing_a_system_prompt_share_it_and_their_question():
    system = [1, 2, 3, 4]
    questions = {"a": [10, 11], "b": [20, 21, 22]}
    sequences = [
        system + questions[group] + [100 + 10 * i + j for j in range(i + 1)]
        for group in ("b", "a")
        for i in range(3)
    ]
    tree = pack_prefix_tree(sequences)
    _check(sequences, tree)
    # The system prompt once, each question once, each answer on its own branch.
    assert tree.num_nodes == len(system) + 2 + 3 + 2 * (1 + 2 + 3)
    visible = tree.visible()
    # Siblings never see each other: the answers of one group, and the two questions.
    first, second = tree.token_index[0, len(system) + 3], tree.token_index[1, len(system) + 3]
    assert not visible[first, second] and not visible[second, first]
    question_a, question_b = tree.token_index[3, len(system)], tree.token_index[0, len(system)]
    assert not visible[question_a, question_b] and not visible[question_b, question_a]
    assert visible[question_a, tree.token_index[3, : len(system)]].all()


def test_empty_sequences_are_refused():
    with pytest.raises(ValueError, match=r"non-empty sequences; got 2 sequence\(s\) with lengths"):
        pack_prefix_tree([[1, 2], []])


def test_chunks_follow_lexicographic_order_and_count_shared_nodes_once():
    sequences = [[1, 2, 3, 4], [7, 8], [1, 2, 3, 5], [1, 2, 9]]
    # Sorted: [1,2,3,4] (4 nodes), [1,2,3,5] (+1), [1,2,9] (+1), [7,8] (+2).
    assert prefix_chunks(sequences, max_nodes=8) == [[0, 2, 3, 1]]
    assert prefix_chunks(sequences, max_nodes=6) == [[0, 2, 3], [1]]
    assert prefix_chunks(sequences, max_nodes=5) == [[0, 2], [3, 1]]
    # A sequence longer than the budget is a chunk of its own.
    assert prefix_chunks(sequences, max_nodes=2) == [[0], [2], [3], [1]]
    for budget in (2, 5, 6, 8):
        for chunk in prefix_chunks(sequences, max_nodes=budget):
            nodes = pack_prefix_tree([sequences[i] for i in chunk]).num_nodes
            assert nodes <= budget or len(chunk) == 1
