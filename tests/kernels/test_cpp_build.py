from __future__ import annotations

import os
import time
from pathlib import Path

from kernels import cpp_build


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils import cpp_extension

    lock = Path(cpp_extension._get_build_directory("hs_lock_test", verbose=False)) / "lock"
    lock.write_text("")
    cpp_build._clear_stale_lock("hs_lock_test")
    assert lock.exists()  # a build may be running
    old = time.time() - cpp_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpp_build._clear_stale_lock("hs_lock_test")
    assert not lock.exists()


def test_the_build_name_follows_the_source(monkeypatch, tmp_path):
    tag = cpp_build._build_tag()
    for src in cpp_build.CSRC.iterdir():
        (tmp_path / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    assert cpp_build._build_tag() == tag
    first = cpp_build.sources()[0]
    first.write_bytes(first.read_bytes() + b"\n// changed\n")
    assert cpp_build._build_tag() != tag
    first.write_bytes(first.read_bytes()[: -len(b"\n// changed\n")])
    (tmp_path / "gemv.h").write_text("// a changed header\n")
    assert cpp_build._build_tag() != tag
