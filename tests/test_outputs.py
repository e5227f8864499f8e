"""Outputs are checked before the work, replaced atomically, and written by one process at a time."""

import json
import os

import pytest

from inference.runtime.errors import UserError
from inference.runtime.outputs import check_output_dir, check_output_file, exclusive, write_atomic


def test_a_kill_between_writing_and_renaming_leaves_the_old_file_whole(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("old")

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]  # no staging file left
    monkeypatch.undo()
    write_atomic(target, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["results.json"]


def test_an_output_file_must_not_be_a_directory_and_its_directory_is_made_up_front(tmp_path):
    with pytest.raises(UserError, match="is a directory; a file name was expected"):
        check_output_file(tmp_path)
    assert check_output_file(tmp_path / "new" / "deeper" / "x.json").parent.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file, not a directory"):
        check_output_file(tmp_path / "file" / "x.json")


def test_an_output_directory_is_never_a_file_or_a_base_model_unless_forced(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file; a directory was expected"):
        check_output_dir(tmp_path / "file")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="holds a base model.*--force"):
        check_output_dir(model)
    assert check_output_dir(model, force=True) == model
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    assert check_output_dir(heads) == heads and check_output_dir(tmp_path / "new") == tmp_path / "new"


def test_an_unwritable_directory_is_said_before_the_work(tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode))
    with pytest.raises(UserError, match="is not writable"):
        check_output_file(tmp_path / "x.json")
    with pytest.raises(UserError, match="is not writable"):
        check_output_dir(tmp_path / "heads")


def test_a_second_writer_stops_with_the_reason_while_the_first_holds_the_file(tmp_path):
    path = tmp_path / "data.jsonl"
    with exclusive(path):
        with pytest.raises(UserError, match="two writers"):
            with exclusive(path, busy="busy: two writers"):
                pass
    with exclusive(path, busy="busy"):  # released when the first one ended
        pass
