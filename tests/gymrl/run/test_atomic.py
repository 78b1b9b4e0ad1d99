"""The staging-then-rename folder helper: readers see a whole folder or none."""

import pytest

from gymrl.run.atomic import atomic_folder, begin, publish, staging_folder


def test_a_clean_exit_publishes_the_folder(tmp_path):
    target = tmp_path / "deep" / "weights_v1"
    with atomic_folder(target, durable=True) as staging:
        assert staging == staging_folder(target) and not target.exists()
        (staging / "a.bin").write_bytes(b"1")
    assert (target / "a.bin").read_bytes() == b"1"
    assert sorted(p.name for p in target.parent.iterdir()) == ["weights_v1"]


def test_a_failure_mid_write_leaves_no_folder_and_the_old_one_intact(tmp_path):
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="crash"), atomic_folder(fresh, durable=False) as staging:
        (staging / "half.bin").write_bytes(b"half")
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []

    old = tmp_path / "old"
    with atomic_folder(old, durable=False) as staging:
        (staging / "v").write_text("1")
    with pytest.raises(RuntimeError, match="crash"), atomic_folder(old, durable=False) as staging:
        (staging / "v").write_text("2")
        raise RuntimeError("crash")
    assert [p.name for p in tmp_path.iterdir()] == ["old"]
    assert (old / "v").read_text() == "1"


def test_publish_replaces_an_existing_folder_and_begin_clears_a_leftover(tmp_path):
    target = tmp_path / "step_3"
    target.mkdir()
    (target / "stale").write_text("old")
    leftover = staging_folder(target)
    leftover.mkdir()
    (leftover / "crashed").write_text("x")
    staging = begin(target)
    assert list(staging.iterdir()) == []
    (staging / "new").write_text("new")
    publish(staging, target, durable=False)
    assert [p.name for p in target.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]
