"""`SamplingParity`: how a training run's policy server resolves a request's sampling."""

from __future__ import annotations

import pickle

import pytest

from gymrl.config.compose import compose_raw
from gymrl.generation.server.sampling_rules import (
    Sampling,
    SamplingCounts,
    SamplingMismatchError,
    SamplingParity,
    SamplingRules,
    training_sampling_rules,
)
from gymrl.preflight.validate import validate_config

TRAINED = Sampling(0.7, 0.95)
GREEDY = Sampling(0.0, 1.0)


def parity(on_mismatch="override", *, validating=True) -> SamplingParity:
    checker = SamplingParity(SamplingRules(TRAINED, frozenset({GREEDY}), on_mismatch))
    checker.set_validating(validating)
    return checker


def test_left_out_fields_are_the_runs_training_values():
    checker = parity()
    assert checker.resolve(None, None) == TRAINED
    assert checker.resolve(0.7, None) == TRAINED
    assert checker.resolve(None, 0.95) == TRAINED
    assert checker.counts() == SamplingCounts()


def test_the_runs_own_settings_are_sampled_as_asked():
    checker = parity()
    assert checker.resolve(0.7, 0.95) == TRAINED
    assert checker.resolve(0.0, 1.0) == GREEDY
    # Greedy decoding ignores top-p, so a greedy request with another top-p is validation's.
    assert checker.resolve(0.0, 0.5) == GREEDY
    assert checker.counts() == SamplingCounts()


def test_validations_sampling_is_a_mismatch_between_validation_passes():
    """Only a validation pass's requests may ask for validation's settings: between passes a
    request at them is a training request sampled wrongly."""
    checker = parity(validating=False)
    assert checker.resolve(0.0, 1.0) == TRAINED
    checker.set_validating(True)
    assert checker.resolve(0.0, 1.0) == GREEDY
    checker.set_validating(False)
    rejecting = parity("reject", validating=False)
    with pytest.raises(SamplingMismatchError) as refused:
        rejecting.resolve(0.0, 1.0)
    assert refused.value.param == "temperature"
    assert "allowed only while a validation pass runs" in str(refused.value)
    assert checker.counts() == SamplingCounts(overridden=1, rejected=0)
    assert rejecting.counts() == SamplingCounts(overridden=0, rejected=1)


def test_override_samples_a_mismatch_at_the_training_settings_and_counts_it():
    checker = parity()
    assert checker.resolve(1.0, None) == TRAINED  # OpenAI's default temperature, sent
    assert checker.resolve(0.7, 1.0) == TRAINED
    assert checker.counts() == SamplingCounts(overridden=2, rejected=0)


def test_reject_refuses_a_mismatch_naming_the_field_and_both_settings():
    checker = parity("reject")
    with pytest.raises(SamplingMismatchError) as refused:
        checker.resolve(0.7, 0.5)
    assert refused.value.param == "top_p"
    message = str(refused.value)
    assert "temperature=0.7, top_p=0.95" in message and "temperature=0.7, top_p=0.5" in message
    assert "generation.server.sampling_mismatch=override" in message
    with pytest.raises(SamplingMismatchError) as hot:
        checker.resolve(1.2, 0.95)
    assert hot.value.param == "temperature"
    assert checker.counts() == SamplingCounts(overridden=0, rejected=2)


def test_the_rules_travel_to_another_process():
    rules = SamplingRules(TRAINED, frozenset({GREEDY}), "reject")
    assert pickle.loads(pickle.dumps(rules)) == rules


def test_a_training_run_allows_validation_sampling_only_when_it_validates():
    validating = validate_config(
        compose_raw(["generation.sampling.temperature=0.7", "grpo.val_period=2"])
    )
    checker = training_sampling_rules(validating)
    assert checker.trained == Sampling(0.7, 1.0)
    assert checker.allowed(validating=True) == {Sampling(0.7, 1.0), GREEDY}
    assert checker.allowed(validating=False) == {Sampling(0.7, 1.0)}
    assert checker.on_mismatch == "override"

    silent = validate_config(
        compose_raw(
            [
                "grpo.val_period=0",
                "grpo.val_at_start=false",
                "grpo.val_at_end=false",
                "generation.server.sampling_mismatch=reject",
            ]
        )
    )
    checker = training_sampling_rules(silent)
    assert checker.allowed(validating=True) == {checker.trained}
    assert checker.on_mismatch == "reject"
