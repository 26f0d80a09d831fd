"""foxhunt_jax.files.write_atomic: the target is the old file or the new one, never a part."""

from __future__ import annotations

import os
import stat

import pytest

from foxhunt_jax.files import write_atomic


def test_bytes_str_and_writer_give_the_same_file(tmp_path):
    text = "a,b\n1,2\n€\n"
    paths = [write_atomic(tmp_path / "bytes.csv", text.encode()),
             write_atomic(tmp_path / "str.csv", text),
             write_atomic(tmp_path / "writer.csv", lambda f: f.write(text.encode()))]
    assert [p.read_bytes() for p in paths] == [text.encode()] * 3
    assert sorted(os.listdir(tmp_path)) == ["bytes.csv", "str.csv", "writer.csv"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, "old")

    def half_then_fail(f):
        f.write(b"new, half")
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        write_atomic(path, half_then_fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_replaces_the_file_and_takes_the_mode(tmp_path):
    path = tmp_path / "entry"
    write_atomic(path, b"x" * 100)
    write_atomic(path, b"y", mode=0o600)
    assert path.read_bytes() == b"y"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "report.png", b"png")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "report.png").stat().st_mode) == 0o644


def test_a_missing_folder_is_an_error_and_writes_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "absent" / "file.json", "{}")
    assert os.listdir(tmp_path) == []
