"""The ownership marker: only directories verl-trainer wrote (or empty ones) are replaced or deleted."""

from __future__ import annotations

import pytest

from verl_trainer.utils.fs import (
    NotOwnedError,
    clean_stale,
    is_owned,
    mark_owned,
    read_marker,
    remove_owned,
    replace_dir_atomically,
)


def _write(text):
    def write(tmp):
        (tmp / "out.txt").write_text(text)

    return write


def test_replace_refuses_a_directory_the_project_did_not_write(tmp_path):
    user = tmp_path / "outputs"
    (user / "run1").mkdir(parents=True)
    (user / "run1" / "metrics.csv").write_text("precious")
    with pytest.raises(NotOwnedError, match=r"export_dir=.*outputs.*did not write.*Choose a new or empty"):
        replace_dir_atomically(user, _write("new"), "hf_export", "export_dir")
    assert (user / "run1" / "metrics.csv").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # no temporary left behind
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotOwnedError, match="is a file"):
        remove_owned(tmp_path / "a_file", "task.dir")


def test_replace_writes_new_empty_and_own_directories_atomically(tmp_path):
    out = tmp_path / "export"
    replace_dir_atomically(out, _write("one"), "hf_export", "export_dir", step=1)
    assert (out / "out.txt").read_text() == "one" and read_marker(out)["kind"] == "hf_export"
    replace_dir_atomically(out, _write("two"), "hf_export", "export_dir")  # ours: replaced
    assert (out / "out.txt").read_text() == "two"
    empty = tmp_path / "empty"
    empty.mkdir()
    replace_dir_atomically(empty, _write("three"), "task", "task.dir")
    assert is_owned(empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "export"]


def test_a_failed_write_leaves_the_old_directory_and_no_temporary(tmp_path):
    out = tmp_path / "export"
    replace_dir_atomically(out, _write("good"), "hf_export", "export_dir")

    def fail(tmp):
        (tmp / "half").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=r"no space left on .*export while writing export_dir \(\d+ bytes free"):
        replace_dir_atomically(out, fail, "hf_export", "export_dir")
    assert (out / "out.txt").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_half_deleted_and_half_written_folders_are_finished_only_if_ours(tmp_path):
    half_deleted = tmp_path / ".step_000001.trash-1a2b3c4d"  # a deletion killed half-way: marker kept
    mark_owned(half_deleted, "checkpoint")
    (half_deleted / "engines").mkdir()
    half_written = tmp_path / ".step_000002.tmp"
    mark_owned(half_written, "checkpoint")
    (half_written / "rng_rank0.pt").write_bytes(b"x")
    foreign = tmp_path / ".notes.tmp"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep")
    removed = clean_stale(tmp_path)
    assert sorted(p.name for p in removed) == [".step_000001.trash-1a2b3c4d", ".step_000002.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.tmp"]


def test_a_deletion_interrupted_half_way_is_hidden_and_finished_later(tmp_path, monkeypatch):
    import verl_trainer.utils.fs as fs

    target = tmp_path / "step_000003"
    mark_owned(target, "checkpoint")
    (target / "engines").mkdir()
    (target / "engines" / "weights").write_text("x")
    (target / "trainer_state.pt").write_text("x")

    def killed(path, *args, **kwargs):
        raise OSError("killed while deleting")

    with monkeypatch.context() as patch:
        patch.setattr(fs.shutil, "rmtree", killed)  # the process dies inside the deletion
        with pytest.raises(OSError, match="killed"):
            remove_owned(target)
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".step_000003.trash-")  # never a "step_N" again
    assert is_owned(left[0])  # the marker goes last, so the remains are still recognisably ours
    assert clean_stale(tmp_path) == left and list(tmp_path.iterdir()) == []


def test_a_directory_is_replaced_only_by_one_of_its_own_kind(tmp_path):
    ckpt = tmp_path / "step_000001"
    mark_owned(ckpt, "checkpoint", run_id="r1")
    (ckpt / "trainer_state.pt").write_text("state")
    refused = r"export_dir=.*step_000001.*'checkpoint' directory.*not a 'hf_export'"
    with pytest.raises(NotOwnedError, match=refused):
        replace_dir_atomically(ckpt, _write("model"), "hf_export", "export_dir")
    with pytest.raises(NotOwnedError, match="'checkpoint' directory"):
        remove_owned(ckpt, "task.dir", kind="task")
    assert (ckpt / "trainer_state.pt").read_text() == "state"
    replace_dir_atomically(ckpt, _write("newer"), "checkpoint", "checkpoint path")  # the same kind: replaced
    assert (ckpt / "out.txt").read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_a_users_file_inside_our_directory_is_never_deleted_with_it(tmp_path):
    out = tmp_path / "hf"
    replace_dir_atomically(out, _write("model"), "hf_export", "export_dir")
    assert read_marker(out)["files"] == ["out.txt"]
    replace_dir_atomically(out, _write("again"), "hf_export", "export_dir")  # only ours: replaced
    (out / "notes").mkdir()
    (out / "notes" / "eval.md").write_text("mine")
    refused = r"export_dir=.*hf' was written by verl-trainer but now also holds files it did not write "
    with pytest.raises(NotOwnedError, match=refused + r"\(notes/eval.md\).*Move those files out"):
        replace_dir_atomically(out, _write("third"), "hf_export", "export_dir")
    with pytest.raises(NotOwnedError, match="notes/eval.md"):
        remove_owned(out, "export_dir")
    assert (out / "notes" / "eval.md").read_text() == "mine" and (out / "out.txt").read_text() == "again"
    mark_owned(out, "warm_start", settings={"a": 1})  # re-marking keeps the record
    assert read_marker(out)["files"] == ["out.txt"]
    (out / "notes" / "eval.md").unlink()
    (out / "notes").rmdir()
    replace_dir_atomically(out, _write("fourth"), "hf_export", "export_dir", replaces=("warm_start",))
    assert (out / "out.txt").read_text() == "fourth"


def test_a_users_file_in_a_nested_directory_of_ours_is_found_too(tmp_path):
    ckpt = tmp_path / "step_000001"

    def write(tmp):
        replace_dir_atomically(tmp / "engines" / "actor", _write("weights"), "checkpoint", "engine")
        (tmp / "trainer_state.pt").write_text("state")

    replace_dir_atomically(ckpt, write, "checkpoint", "checkpoint path")
    assert read_marker(ckpt)["files"] == ["engines/", "trainer_state.pt"]
    (ckpt / "engines" / "actor" / "mine.txt").write_text("mine")
    with pytest.raises(NotOwnedError, match=r"files it did not write \(engines/actor/mine.txt\)"):
        remove_owned(ckpt, "checkpoint", kind="checkpoint")
    assert (ckpt / "engines" / "actor" / "mine.txt").read_text() == "mine"
