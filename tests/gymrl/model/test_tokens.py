"""The tokenizer's special ids as ints (or a clear error) and the text of one sequence."""

import copy

import pytest

from gymrl.model.tokens import decode_text, eos_token_id, pad_token_id, single_token_id


@pytest.fixture
def bare_tokenizer(tokenizer):
    """The SmolLM2 tokenizer without a pad token and without an end-of-sequence token."""
    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    bare.eos_token = None
    return bare


def test_the_smollm2_ids_are_ints(tokenizer):
    assert eos_token_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert pad_token_id(tokenizer) == tokenizer.pad_token_id
    assert single_token_id(tokenizer.bos_token_id) == tokenizer.bos_token_id


def test_a_missing_pad_token_pads_with_the_end_of_sequence_token(tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    assert pad_token_id(no_pad) == eos_token_id(tokenizer)


def test_a_tokenizer_without_an_end_of_sequence_token_is_refused(bare_tokenizer):
    assert single_token_id(bare_tokenizer.eos_token_id) is None
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        eos_token_id(bare_tokenizer)
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        pad_token_id(bare_tokenizer)


def test_one_sequence_decodes_to_one_string(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert decode_text(tokenizer, tuple(ids), skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>"
    )
    assert decode_text(tokenizer, ids, skip_special_tokens=True) == "user\nhi"
    assert decode_text(tokenizer, [], skip_special_tokens=False) == ""
