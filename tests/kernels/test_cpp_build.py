from __future__ import annotations

import subprocess
import sys

from kernels import cpp_build

HOLD = """
import fcntl, sys, time
fh = open(sys.argv[1], "w")
fcntl.flock(fh, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_dead_builders_baton_is_removed_and_a_live_builders_kept(tmp_path):
    baton = tmp_path / "lock"
    baton.write_text("")
    holder = subprocess.Popen(  # a live builder holds the guard
        [sys.executable, "-c", HOLD, str(tmp_path / "builder.flock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with cpp_build.build_guard(tmp_path, wait=False) as held:
            assert not held and baton.exists()
    finally:
        holder.communicate("")  # it exits: the kernel drops its lock
    with cpp_build.build_guard(tmp_path, wait=False) as held:
        assert held and not baton.exists()


def test_the_build_name_follows_the_source(monkeypatch, tmp_path):
    """Sources, headers and their directory name the build: another checkout of the same
    sources builds its own (a shared build's ninja file would name the other's paths)."""
    here = cpp_build._build_tag()
    for src in cpp_build.CSRC.iterdir():
        if src.is_file():
            (tmp_path / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    tag = cpp_build._build_tag()
    assert tag != here and cpp_build._build_tag() == tag
    first = cpp_build.sources()[0]
    first.write_bytes(first.read_bytes() + b"\n// changed\n")
    assert cpp_build._build_tag() != tag
    first.write_bytes(first.read_bytes()[: -len(b"\n// changed\n")])
    (tmp_path / "gemv.h").write_text("// a changed header\n")
    assert cpp_build._build_tag() != tag
