"""The tokenizer's special ids as ints (or a clear error), the text of one sequence, and the
end ids a model's own files declare."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.server.parsers import GenerationParser
from gymrl.model.tokens import (
    decode_text,
    eos_token_id,
    model_end_token_ids,
    pad_token_id,
    policy_end_token_ids,
    single_token_id,
)

CONF = Path(__file__).resolve().parents[3] / "conf"


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


def test_model_end_ids_are_those_of_config_and_generation_config(tmp_path):
    """Qwen3's shape: config.json ends at <|im_end|>, generation_config.json adds
    <|endoftext|>; both are where SGLang stops a request."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [151645, 151643], "top_k": 20})
    )
    assert model_end_token_ids(tmp_path) == (151645, 151643)
    assert model_end_token_ids(tmp_path / "absent") == ()  # a hub id declares nothing here


def test_the_flagship_declares_qwen3_end_ids_its_tokenizer_names(qwen3_tokenizer, tmp_path):
    """conf/policy/qwen3_30b_a3b.yaml names a hub id, whose files are not read here: without
    declared end ids the abort cut would resume past the model's end."""
    policy = yaml.safe_load((CONF / "policy" / "qwen3_30b_a3b.yaml").read_text())
    ends = qwen3_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tuple(policy["end_token_ids"]) == tuple(ends) == (151645, 151643)
    assert policy_end_token_ids(policy["path"], policy["end_token_ids"]) == (151645, 151643)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert policy_end_token_ids(tmp_path, [7, 2]) == (2, 7)


def test_the_chat_format_stops_at_the_model_end_ids(tokenizer):
    chat_format = ChatFormat(
        tokenizer, parser=GenerationParser("hermes"), model_end_ids=[eos_token_id(tokenizer), 7]
    )
    assert chat_format.stop_token_ids == (chat_format.end_of_turn_id, 7)
