"""The newest releases, early: this checkout installed as a user without `make` installs it.

A scratch venv gets the Makefile's torch pin (TORCH_SPEC, a CPU wheel pip finds here; never a
CUDA build) and then a copy of this checkout, non-editable and without constraints.txt, so pip
resolves the newest release of everything else; Hugging Face's `kernels` distribution is made
sure of beside it. Then, from a directory outside the checkout: the `hybrid-serve` console
script writes the tiny preset, serves it on a loopback port and answers one chat completion;
one process imports transformers' NemotronH and `hybrid_serve.kernels` beside HF's `kernels`;
and one short parity check holds our model to transformers'. A failure names the releases that
differ from constraints.txt (the set the suite last passed with); a pass with different
releases says so in a warning (time for `make constraints`). Network: PyPI only, through pip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import constraints

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("fresh_env_probe.py")

VENV_TIMEOUT_S = 120
PIP_TIMEOUT_S = 600  # the whole dependency set from PyPI on a cold cache
MAKE_MODEL_TIMEOUT_S = 300
START_TIMEOUT_S = 240  # the server's start, compiling the C++ kernels where none are cached
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
LEFT_S = 10  # for the server's children to end after it
PROBE_TIMEOUT_S = 300
PIP_LINES = 30  # of pip's output in a failure's message

# transformers' fp32 logits, ours against them: the exact (float64) reference, and its fp32
# run, whose own round-off reaches ~1e-4 on some CPUs (tests/models/test_parity.py)
ATOL = 1e-4
ATOL_FP32_REFERENCE = 2e-4
NEW_TOKENS = 8  # of the chat completion

# the checkout's copy: what a source distribution would hold, not its caches or build trees
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", "checkpoints",
    "hybrid_serve_cpu_*",
)  # fmt: skip


class NewReleasesPass(UserWarning):
    """The checks pass with the newest releases, and those differ from the tested set."""


def torch_spec() -> str:
    """The Makefile's default torch pin (`TORCH_SPEC ?= torch==X`): an exact release."""
    m = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert m and re.fullmatch(r"torch==[\w.+]+", m.group(1)), "Makefile: no exact TORCH_SPEC"
    return m.group(1)


def tail(output: str, lines: int = PIP_LINES) -> str:
    """The last `lines` lines of a command's output, without pip's notes on this machine's
    configured local index folders (`WARNING: Location 'file:...' is ignored`)."""
    kept = [ln for ln in output.splitlines() if not ln.startswith("WARNING: Location 'file:")]
    return "\n".join(kept[-lines:])


def partial_output(e: subprocess.TimeoutExpired) -> str:
    """What a timed-out command had written (TimeoutExpired holds bytes even with text=True)."""
    parts = [e.stdout, e.stderr]
    return "".join(p.decode(errors="replace") if isinstance(p, bytes) else p or "" for p in parts)


@dataclass
class Scratch:
    """The scratch environment. `error` says why building it failed (None: it is complete);
    every command runs in `work`, outside the checkout, with `env`."""

    venv: Path
    work: Path
    env: dict[str, str]
    error: str | None = None
    kernels_installed_separately: bool = False

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """`args` run to completion (stdout and stderr kept apart). Raises TimeoutExpired."""
        return subprocess.run(
            list(args), cwd=self.work, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip

    def step(self, what: str, *args: str, timeout: float) -> bool:
        """Run one installation step; on a non-zero exit or a timeout record `error` (with the
        output's last lines) and return False."""
        try:
            out = self.run(*args, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            self.error = f"{what}: timed out after {timeout:.0f}s\n{tail(partial_output(e))}"
            return False
        if out.returncode != 0:
            self.error = f"{what}: exit {out.returncode}\n{tail(out.stdout + out.stderr)}"
            return False
        return True

    def what_moved(self) -> str:
        """The releases here that differ from constraints.txt, as one line."""
        try:
            installed = constraints.parse_freeze(constraints.freeze(self.bin("python")))
        except (subprocess.SubprocessError, OSError) as e:
            return f"(pip freeze of the scratch environment failed: {e})"
        moved = constraints.differences(constraints.read_pins(), installed)
        return ", ".join(moved) if moved else "none"

    def require(self) -> None:
        """Fail (not skip) where the environment could not be built."""
        if self.error is not None:
            raise AssertionError(f"{self.error}\n\n{self.moved_line()}")

    def moved_line(self) -> str:
        return f"newest releases that differ from the tested set: {self.what_moved()}"


@contextmanager
def naming_what_moved(scratch: Scratch) -> Iterator[None]:
    """Any failure inside, re-raised as an AssertionError that ends with what moved."""
    try:
        yield
    except Exception as e:
        what = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
        raise AssertionError(f"{what}\n\n{scratch.moved_line()}") from e


def scratch_env(work: Path) -> dict[str, str]:
    """This process's environment less what would import the checkout or this venv's
    packages, or change how the installed code runs (triton's interpreter switch)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "TRITON_INTERPRET"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PYTHONNOUSERSITE="1",
        OMP_NUM_THREADS="1",  # a tiny model; two threads per process collapse on a busy machine
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HOME=env.get("HOME", str(work)),
    )
    return env


def cuda_packages(report: Path) -> list[str]:
    """The nvidia-* / cuda-* distributions a `pip install --dry-run --report` would install."""
    names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    return sorted(n for n in names if re.match(r"(nvidia|cuda)[-_]", n, re.I))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Iterator[Scratch]:
    """The scratch environment, built step by step; the first failing step stops it and is
    recorded in `Scratch.error` (each test fails with it). Removed after the module."""
    root = tmp_path_factory.mktemp("fresh_install")
    work = root / "work"
    work.mkdir()
    s = Scratch(root / "venv", work, scratch_env(work))
    pip = (s.bin("python"), "-m", "pip")
    # --no-compile: pip would byte-compile all of torch (most of a minute here); what runs
    # compiles as it imports
    opts = ("--progress-bar", "off", "--disable-pip-version-check", "--no-compile")
    spec = torch_spec()
    report = root / "torch-report.json"
    src = root / "src"
    dry_run = ("--dry-run", "--quiet", "--report", str(report))
    ok = (
        s.step("python -m venv", sys.executable, "-m", "venv", str(s.venv), timeout=VENV_TIMEOUT_S)
        and s.step("upgrade pip", *pip, "install", *opts, "-U", "pip", timeout=PIP_TIMEOUT_S)
        and s.step(f"resolve {spec}", *pip, "install", *opts, *dry_run, spec, timeout=PIP_TIMEOUT_S)
    )
    if ok and (cuda := cuda_packages(report)):
        s.error = (
            f"pip resolves {spec} to a CUDA build here (it would install {', '.join(cuda)}): "
            "a CPU wheel of it must be where pip finds it (e.g. PIP_FIND_LINKS)"
        )
        ok = False
    ok = ok and s.step(f"install {spec}", *pip, "install", *opts, spec, timeout=PIP_TIMEOUT_S)
    if ok:
        shutil.copytree(ROOT, src, ignore=COPY_IGNORE)
        ok = s.step(
            "install the checkout (non-editable, no constraints)",
            *pip, "install", *opts, str(src), timeout=PIP_TIMEOUT_S,
        )  # fmt: skip
    if ok and s.run(*pip, "show", "--quiet", "kernels", timeout=PIP_TIMEOUT_S).returncode != 0:
        # the newest transformers no longer pulls Hugging Face's kernels: it is still the name
        # our packages must not collide with, so install it beside them
        s.kernels_installed_separately = True
        s.step("install kernels", *pip, "install", *opts, "kernels", timeout=PIP_TIMEOUT_S)
    yield s
    # ~1.5 GB that pytest would keep among its last three temporary trees; the logs stay
    shutil.rmtree(s.venv, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)


def test_the_newest_releases_install(scratch):
    """The install steps above all succeed; where the newest releases differ from the tested
    set and everything here passes, a warning names them."""
    scratch.require()
    assert not scratch.work.resolve().is_relative_to(ROOT)
    moved = scratch.what_moved()
    if moved != "none":
        warnings.warn(
            f"the newest releases differ from constraints.txt: {moved} "
            "(if the whole suite passes with them, `make constraints` records them)",
            NewReleasesPass,
            stacklevel=1,
        )
    if scratch.kernels_installed_separately:
        warnings.warn(
            "the newest transformers no longer pulls Hugging Face's kernels (installed here "
            "by name, so the import-name check still runs beside it)",
            NewReleasesPass,
            stacklevel=1,
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Return once GET /health answers 200; raise where the server exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(
        f"the server was not healthy in {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}"
    )


def children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, timeout=30
    )
    return [int(x) for x in out.stdout.split()]


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    except (ProcessLookupError, FileNotFoundError):
        return False


def stop(proc: subprocess.Popen) -> tuple[int | None, list[int]]:
    """SIGTERM to the server: its exit status (None where it had to be killed) and the children
    it had that outlived it by LEFT_S (killed now)."""
    kids = children(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    status = None
    try:
        status = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session, the leader not yet reaped
        proc.wait()
    deadline = time.monotonic() + LEFT_S
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [k for k in kids if alive(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    return status, left


def test_the_console_script_serves_the_tiny_preset(scratch):
    """`hybrid-serve make-model --preset tiny`, then `hybrid-serve` on it, bound to 127.0.0.1:
    one chat completion answers 200 with NEW_TOKENS generated tokens of text, and SIGTERM
    stops the server with exit status 0."""
    scratch.require()
    with naming_what_moved(scratch):
        model = scratch.work / "tiny"
        made = scratch.run(
            scratch.bin("hybrid-serve"), "make-model", "--preset", "tiny", "--out", str(model),
            timeout=MAKE_MODEL_TIMEOUT_S,
        )  # fmt: skip
        if made.returncode != 0:
            raise AssertionError(
                f"hybrid-serve make-model: exit {made.returncode}\n{tail(made.stderr)}"
            )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = scratch.work / "server.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [scratch.bin("hybrid-serve"), "--model-path", str(model), "--host", "127.0.0.1",
                 "--port", str(port), "--log-level", "warning"],
                cwd=scratch.work, env=scratch.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            wait_healthy(proc, url, log)
            with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
                name = http.get("/v1/models").json()["data"][0]["id"]
                answer = http.post(
                    "/v1/chat/completions",
                    json={
                        "model": name,
                        "messages": [{"role": "user", "content": "Say hello."}],
                        "max_tokens": NEW_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
        finally:
            status, left = stop(proc)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        text = body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == NEW_TOKENS, body
        assert isinstance(text, str) and text.strip(), body
        assert status == 0, f"the server's exit status on SIGTERM: {status}\n{log.read_text()}"
        assert not left, f"processes the server left behind: {left}"


def test_transformers_nemotron_h_and_our_kernels_import_together_and_agree(scratch):
    """One process (tests/fresh_env_probe.py, copied out of the checkout): HF's `kernels` and
    `hybrid_serve.kernels` each from its own distribution's files in the scratch site-packages,
    beside transformers' NemotronH; then the tiny preset's last-token logits within ATOL of
    transformers' exact ones and its greedy tokens equal to transformers' `generate`."""
    scratch.require()
    with naming_what_moved(scratch):
        probe = scratch.work / PROBE.name
        shutil.copyfile(PROBE, probe)
        out = scratch.run(
            scratch.bin("python"), str(probe), str(scratch.work), timeout=PROBE_TIMEOUT_S
        )
        if out.returncode != 0:
            raise AssertionError(f"{PROBE.name}: exit {out.returncode}\n{tail(out.stderr)}")
        found = json.loads(out.stdout.strip().splitlines()[-1])
        where, parity = found["imports"], found["parity"]
        site = Path(where["site_packages"]).resolve()
        hf_kernels = Path(where["kernels"]).resolve()
        ours = Path(where["hybrid_serve.kernels"]).resolve()
        assert hf_kernels == Path(where["kernels_distribution_file"]).resolve(), where
        assert ours == Path(where["hybrid_serve_distribution_file"]).resolve(), where
        assert hf_kernels.is_relative_to(site) and ours.is_relative_to(site), where
        assert not ours.is_relative_to(ROOT), where
        assert where["NemotronHForCausalLM"] == "NemotronHForCausalLM", where
        assert parity["max_dlogit_float64"] < ATOL, parity
        assert parity["max_dlogit_fp32"] < ATOL_FP32_REFERENCE, parity
        assert parity["ours"] == parity["transformers"], parity
