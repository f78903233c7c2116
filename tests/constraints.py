"""constraints.txt, the set of releases the suite last passed with: read it, compare an
environment's `pip freeze` with it, and write it anew from this interpreter's environment.

    python -m tests.constraints      (what `make constraints` runs after a green `make test`)

The file pins every distribution `pip freeze` lists except `UNPINNED`, one `name==version` a
line. A pin's reason is its inline comment (`  # ...`); rewriting keeps each name's reason, so
the direct dependencies keep theirs and the header covers the rest. Imports nothing beyond the
standard library: the fresh-install test runs it against a scratch environment's freeze.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
# Left out of the file: this project itself; torch, whose build (CPU or CUDA) the Makefile's
# TORCH_SPEC / TORCH_INDEX pick; triton, which a CUDA torch pins to the release it was built
# with (torch 2.13.0 from PyPI requires triton==3.7.1), so a pin here would contradict it.
UNPINNED = ("hybrid-serve", "torch", "triton")
FREEZE_TIMEOUT_S = 120

HEADER = """\
# The releases the test suite last passed with (`make test`, CPU torch), pinned exactly.
# `make install` (so `make test`, `make serve` and the Docker images) installs with
# `pip install -c constraints.txt`; pyproject.toml keeps ranges for those who embed the package.
# Regenerate after a green run: `make constraints` runs the suite and, if it passes, rewrites
# this file from .venv's `pip freeze` (python -m tests.constraints), keeping each line's reason.
# A reason is on each direct dependency's line; the lines without one are their dependencies,
# pinned for the same reason as the whole file: this is the set that passed.
# Left out: hybrid-serve; torch (the Makefile's TORCH_SPEC, a CPU or CUDA build); triton, which
# a CUDA torch pins to its own build (PyPI's torch 2.13.0 requires triton==3.7.1).
"""


@dataclass(frozen=True)
class Pin:
    """One line of the file: the name as written, its exact version, and its reason (or "")."""

    name: str
    version: str
    reason: str


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): `PyYAML` and `pyyaml` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_freeze(text: str) -> dict[str, tuple[str, str]]:
    """`pip freeze` output -> canonical name -> (name as written, version), for its
    `name==version` lines; comments, editable installs (`-e ...`) and direct references
    (`name @ url`) are dropped."""
    found = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        if m:
            found[canonical(m.group(1))] = (m.group(1), m.group(2))
    return found


def read_pins(path: Path = CONSTRAINTS) -> dict[str, Pin]:
    """canonical name -> `Pin` for each `name==version` line of `path`. Raises ValueError on a
    line that is neither a comment, blank, nor an exact pin."""
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        body, _, reason = line.partition("#")
        if not body.strip():
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", body.strip())
        if not m:
            raise ValueError(f"{path.name}:{number}: not an exact pin: {line!r}")
        pins[canonical(m.group(1))] = Pin(m.group(1), m.group(2), reason.strip())
    return pins


def freeze(python: Path | str = sys.executable) -> str:
    """`pip freeze --exclude-editable` of the environment `python` runs in. Raises
    subprocess.CalledProcessError or TimeoutExpired."""
    out = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
        timeout=FREEZE_TIMEOUT_S,
    )
    return out.stdout


def differences(pins: dict[str, Pin], installed: dict[str, tuple[str, str]]) -> list[str]:
    """What an environment has that the pins do not: `name pinned -> installed` for a version
    that differs, `name (not in the tested set) version` for a distribution the file lacks.
    `UNPINNED` are not compared; a pin the environment lacks (a dev tool) is no difference."""
    out = []
    for key, (name, version) in sorted(installed.items()):
        if key in UNPINNED:
            continue
        pin = pins.get(key)
        if pin is None:
            out.append(f"{name} (not in the tested set) {version}")
        elif pin.version != version:
            out.append(f"{name} {pin.version} -> {version}")
    return out


def render(installed: dict[str, tuple[str, str]], reasons: dict[str, str]) -> str:
    """The file's text: `HEADER`, then one pin a line in name order, each with its reason from
    `reasons` (canonical name -> text) where it has one."""
    lines = [HEADER]
    for key, (name, version) in sorted(installed.items()):
        if key in UNPINNED:
            continue
        pin = f"{name}=={version}"
        lines.append(f"{pin}  # {reasons[key]}\n" if reasons.get(key) else f"{pin}\n")
    return "".join(lines)


def main() -> int:
    """Rewrite constraints.txt from this interpreter's environment, keeping the reasons."""
    old = read_pins() if CONSTRAINTS.exists() else {}
    installed = parse_freeze(freeze())
    CONSTRAINTS.write_text(render(installed, {k: p.reason for k, p in old.items()}))
    new = read_pins()
    sys.stdout.write(f"{CONSTRAINTS.name}: {len(new)} pins\n")
    for key in sorted(old.keys() | new.keys()):
        was, now = old.get(key), new.get(key)
        if was is None or now is None or was.version != now.version:
            before = was.version if was else "(new)"
            after = now.version if now else "(no longer installed)"
            sys.stdout.write(f"  {(now or was).name} {before} -> {after}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
