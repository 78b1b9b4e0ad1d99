"""Checkpoint round trip with a tiny tied-weight model and AdamW, pruning, and partial saves;
the state schema both trainers share, with its RNG restore; the manifest's hashes, old and new."""

import hashlib
import json
import random

import numpy as np
import pytest
import torch
import xxhash

from gymrl.run.checkpoint import (
    COMPLETE_MARKER,
    MANIFEST_FILE,
    STATE_FILE,
    CorruptCheckpointError,
    TrainerState,
    capture_rng_state,
    hash_files,
    latest_checkpoint,
    latest_verified_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
)


class TinyLM(torch.nn.Module):
    """Embedding tied to the output head, like SmolLM2: safetensors must handle shared storage."""

    def __init__(self, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 4)
        self.mix = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _trained(seed):
    model = TinyLM(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum().backward()
    optimizer.step()
    return model, optimizer


def _state(step, data_state=None):
    return TrainerState(
        step=step,
        weight_version=step,
        data_state=data_state if data_state is not None else {"epoch": 1, "index": step},
        rng=[capture_rng_state()],
        extra={"seed": 7},
    )


def _save(directory, step, model, optimizer, keep_last=3, data_state=None):
    return save_checkpoint(
        directory, model, optimizer, _state(step, data_state), keep_last=keep_last
    )


def test_round_trip_restores_weights_optimizer_counters_and_rng(tmp_path):
    model, optimizer = _trained(seed=0)
    path = _save(tmp_path, 5, model, optimizer, data_state={"epoch": 2, "order": [3, 1, 2]})
    assert path == tmp_path / "step_5"
    expected_python, expected_torch = random.random(), torch.rand(3)

    fresh_model, fresh_optimizer = _trained(seed=1)
    state = load_checkpoint(path, fresh_model, fresh_optimizer).resume_info()

    assert state == {
        "step": 5,
        "weight_version": 5,
        "data_state": {"epoch": 2, "order": [3, 1, 2]},
        "extra": {"seed": 7},
    }
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(fresh_model.state_dict()[name], tensor, rtol=0, atol=0)
    assert fresh_model.head.weight is fresh_model.embed.weight
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for index, slots in saved["state"].items():
        for key, value in slots.items():
            torch.testing.assert_close(loaded["state"][index][key], value, rtol=0, atol=0)
    # RNG states are those at save time: the same draws come again.
    assert random.random() == expected_python
    torch.testing.assert_close(torch.rand(3), expected_torch, rtol=0, atol=0)


def test_keep_last_prunes_older_checkpoints(tmp_path):
    model, optimizer = _trained(seed=0)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, optimizer, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"


def test_partial_checkpoints_are_ignored_and_leftovers_cleaned(tmp_path):
    model, optimizer = _trained(seed=0)
    _save(tmp_path, 4, model, optimizer)
    partial = tmp_path / "step_9"
    partial.mkdir()
    (partial / "gymrl_state.json").write_text("{}")
    leftover = tmp_path / ".tmp-step_10-abc"
    leftover.mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    with pytest.raises(FileNotFoundError, match=f"no {COMPLETE_MARKER} marker"):
        load_checkpoint(partial, model, optimizer)
    _save(tmp_path, 5, model, optimizer)
    assert not leftover.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_5"


def test_saving_an_existing_step_replaces_it(tmp_path):
    model, optimizer = _trained(seed=0)
    _save(tmp_path, 3, model, optimizer, data_state={"index": 1})
    _save(tmp_path, 3, model, optimizer, data_state={"index": 2})
    state = json.loads((tmp_path / "step_3" / "gymrl_state.json").read_text())
    assert state["data_state"] == {"index": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


def test_no_checkpoint_and_unserialisable_state(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="data_state must be JSON-serialisable"):
        _state(1, data_state={"position": torch.tensor(3)})
    with pytest.raises(ValueError, match="step must be >= 0"):
        _state(-1)


def test_a_failed_save_leaves_no_folder_and_keeps_the_previous(tmp_path):
    model, optimizer = _trained(seed=0)
    _save(tmp_path, 3, model, optimizer, data_state={"index": 1})

    class Unsaveable(torch.optim.AdamW):
        def state_dict(self):
            raise OSError("disk full")

    broken = Unsaveable(model.parameters())
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 3, model, broken, data_state={"index": 2})
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 4, model, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    assert TrainerState.read(tmp_path / "step_3").data_state == {"index": 1}


def test_state_schema_round_trips_and_rng_restore_repeats_the_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = TrainerState(
        step=4,
        weight_version=9,
        data_state={"position": 12},
        rng=[capture_rng_state(), {"rank": "another rank's states"}],
        extra={"scheduler": {"num_steps": 4}},
    )
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    state.write(tmp_path)
    assert (tmp_path / COMPLETE_MARKER).read_text() == "4\n"

    random.random(), np.random.rand(5), torch.rand(5)  # move every generator on
    read = TrainerState.read(tmp_path)
    assert read == state
    restore_rng_state(read.rng[0])
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == draws


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reported"),
    [
        (lambda folder: _truncate(folder / "optimizer.pt"), r"optimizer.pt has \d+ bytes, not"),
        (lambda folder: _flip_one_byte(folder / "model.safetensors"), "model.safetensors does not"),
        (lambda folder: (folder / "gymrl_state.json").unlink(), "gymrl_state.json is missing"),
        (lambda folder: (folder / MANIFEST_FILE).unlink(), f"no readable {MANIFEST_FILE}"),
    ],
    ids=["cut-short", "bit-flip", "file-lost", "no-manifest"],
)
def test_a_damaged_checkpoint_is_reported_and_the_previous_complete_one_used(
    tmp_path, damage, reported
):
    model, optimizer = _trained(seed=0)
    _save(tmp_path, 2, model, optimizer)
    newest = _save(tmp_path, 3, model, optimizer)
    assert latest_verified_checkpoint(tmp_path) == (newest, [])
    manifest = json.loads((newest / MANIFEST_FILE).read_text())["files"]
    assert sorted(manifest) == ["gymrl_state.json", "model.safetensors", "optimizer.pt"]

    damage(newest)

    assert latest_checkpoint(tmp_path) == newest  # the marker alone cannot tell
    with pytest.raises(CorruptCheckpointError, match=reported):
        verify_checkpoint(newest)
    chosen, rejected = latest_verified_checkpoint(tmp_path)
    assert chosen == tmp_path / "step_2"
    assert len(rejected) == 1 and "step_3" in rejected[0]
    fresh_model, fresh_optimizer = _trained(seed=1)
    assert load_checkpoint(chosen, fresh_model, fresh_optimizer).step == 2


def test_when_every_checkpoint_is_damaged_none_is_chosen(tmp_path):
    model, optimizer = _trained(seed=0)
    _flip_one_byte(_save(tmp_path, 1, model, optimizer) / "optimizer.pt")
    chosen, rejected = latest_verified_checkpoint(tmp_path)
    assert chosen is None
    assert rejected == [f"{tmp_path / 'step_1'}: optimizer.pt does not match its xxh3-128"]
    assert latest_verified_checkpoint(tmp_path / "missing") == (None, [])


def test_the_manifest_names_its_hash_and_holds_each_files_xxh3_128(tmp_path):
    model, optimizer = _trained(seed=0)
    folder = _save(tmp_path, 1, model, optimizer)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["hash"] == "xxh3_128"
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}


def _rewrite_as_an_earlier_version(folder):
    """The checkpoint as versions before issue 22 wrote it: the state in `trainer_state.json`,
    the manifest with no "hash" field and a "sha256" per file."""
    (folder / STATE_FILE).rename(folder / "trainer_state.json")
    files = {}
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        data = (folder / name).read_bytes()
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}))


def test_a_checkpoint_of_an_earlier_version_still_verifies_and_resumes(tmp_path):
    model, optimizer = _trained(seed=0)
    _save(tmp_path, 1, model, optimizer)
    older = _save(tmp_path, 2, model, optimizer)
    _rewrite_as_an_earlier_version(older)
    assert not (older / STATE_FILE).exists()
    assert latest_verified_checkpoint(tmp_path) == (older, [])
    fresh_model, fresh_optimizer = _trained(seed=1)
    assert load_checkpoint(older, fresh_model, fresh_optimizer).step == 2

    _flip_one_byte(older / "model.safetensors")
    chosen, rejected = latest_verified_checkpoint(tmp_path)
    assert chosen == tmp_path / "step_1"
    assert rejected == [f"{older}: model.safetensors does not match its SHA-256"]


def test_a_manifest_naming_an_unknown_hash_is_reported_and_skipped(tmp_path):
    model, optimizer = _trained(seed=0)
    _save(tmp_path, 1, model, optimizer)
    newest = _save(tmp_path, 2, model, optimizer)
    manifest = json.loads((newest / MANIFEST_FILE).read_text())
    (newest / MANIFEST_FILE).write_text(json.dumps({**manifest, "hash": "blake3"}))
    chosen, rejected = latest_verified_checkpoint(tmp_path)
    assert chosen == tmp_path / "step_1"
    assert len(rejected) == 1 and "names the hash 'blake3'" in rejected[0]


def test_entries_another_rank_hashed_go_into_the_manifest_as_given(tmp_path):
    """A Megatron rank hashes its own shards; rank 0 hashes only what no rank reported."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__1_0.distcp").write_bytes(b"rank 1's shard")
    (tmp_path / "megatron" / ".metadata").write_bytes(b"metadata")
    reported = {"megatron/__1_0.distcp": {"bytes": 14, "xxh3_128": "rank 1's digest"}}
    write_manifest(tmp_path, reported)
    files = json.loads((tmp_path / MANIFEST_FILE).read_text())["files"]
    assert files == {**reported, **hash_files(tmp_path, ["megatron/.metadata"])}
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp does not match its xxh3-128"):
        verify_checkpoint(tmp_path)  # not re-hashed at save, but checked at resume
