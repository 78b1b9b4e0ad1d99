"""The venvs `make` builds in this checkout, looked for before a run: what the CPU experiments
need and lacks is named with its make target; interpreters elsewhere are not looked for."""

import pytest

from gymrl.config import compose
from gymrl.config.compose import compose_raw
from gymrl.preflight import venvs
from gymrl.preflight.validate import validate_config
from gymrl.preflight.venvs import missing_venvs, render_missing


@pytest.fixture
def empty_checkout(tmp_path, monkeypatch):
    """A checkout root where no venv has been made: `${repo_path:...}` resolves into it."""
    monkeypatch.setattr(compose, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(venvs, "REPO_ROOT", tmp_path)
    return tmp_path


def _flagship(*overrides):
    return validate_config(compose_raw(["+experiment=flagship_cpu", *overrides]))


def test_the_flagships_three_venvs_are_named_with_their_make_targets(empty_checkout):
    missing = missing_venvs(_flagship())
    assert [(venv.key, venv.target) for venv in missing] == [
        ("cluster.roles.trainer.python", "megatron-venv"),
        ("generation.launch.python", "sglang-venv"),
        ("env.gym.venv", "gym-venv"),
    ]
    assert missing[1].path == str(empty_checkout / ".venv-sglang" / "bin" / "python")
    assert render_missing(missing).startswith(
        "environments missing on this machine (`make megatron-venv sglang-venv gym-venv` makes "
        "them):\n  - cluster.roles.trainer.python = "
    )


def test_a_made_venv_is_not_named(empty_checkout):
    python = empty_checkout / ".venv-sglang" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    keys = [venv.key for venv in missing_venvs(_flagship())]
    assert keys == ["cluster.roles.trainer.python", "env.gym.venv"]


def test_interpreters_outside_the_checkouts_venvs_are_not_looked_for(empty_checkout):
    """A cluster's environments may exist on its workers' nodes only."""
    config = _flagship(
        "cluster.roles.trainer.python=/opt/envs/megatron/bin/python",
        f"generation.launch.python={empty_checkout}/elsewhere/bin/python",
    )
    assert [venv.key for venv in missing_venvs(config)] == ["env.gym.venv"]
