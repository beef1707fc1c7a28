"""minigpt.io: atomic writes leave no partial file, and their files get the mode any new file would get."""
import os
import stat

import pytest

from minigpt.io import atomic_write_bytes, umask, usual_mode


@pytest.fixture(params=[0o022, 0o077, 0o002])
def mask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_umask_is_read_without_changing_it(mask):
    assert umask() == mask
    assert umask() == mask


def test_atomic_files_get_the_umask_mode_not_tempfile_private_one(tmp_path, mask):
    path = tmp_path / "a" / "file.json"
    atomic_write_bytes(path, b"{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask == usual_mode()
    assert path.read_bytes() == b"{}" and [p.name for p in path.parent.iterdir()] == ["file.json"]
    assert usual_mode(folder=True) == 0o777 & ~mask


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "file.bin"
    atomic_write_bytes(path, b"old")

    def broken(*args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["file.bin"]
