"""llama.cpp's side of `benchmarks.roofline`: each `--gguf` served by its own llama-server
(`benchmarks.llama_cpp`'s commands and HTTP waves), its output tok/s per concurrency as a row,
and a server that fails to start or during its waves kept as a note with llama.cpp's own error
line, so one refused GGUF costs its rows, never the run's."""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import tempfile
from collections.abc import Callable
from contextlib import ExitStack, redirect_stdout
from pathlib import Path

logger = logging.getLogger("benchmarks.roofline")

LLAMA_NAMES = {"f32": "float32", "bf16": "bfloat16", "q8_0": "int8", "q4_0": "int4"}
OUR_FORMATS = tuple(LLAMA_NAMES.values())
# the peak llama.cpp's products of a format run at, any batch (ggml's CPU backend multiplies
# bf16 with its bf16 dot product and Q8_0/Q4_0 against Q8_0 activations in int8 dot products)
LLAMA_CEILING = {"float32": "fp32_fma", "bfloat16": "bf16_dot", "int8": "int8_dot",
                 "int4": "int8_dot"}  # fmt: skip
LLAMA_PENDING = "pending: its servers start after our rows"
LLAMA_MEASURED = "HTTP output throughput (prefill included)"
NO_LLAMA = "absent: no --llama-server / --gguf given"
LOG_TAIL = 8  # lines of a failed llama-server's log kept in its note
ERROR_SEARCH = 40  # its last lines searched for the error line


def parse_gguf(text: str, formats: list[str]) -> list[tuple[str, str, str]]:
    """`--gguf` NAME=FILE items -> (name, our format, file); ValueError for a name that maps to
    none of our formats or to one not in `formats`."""
    out = []
    for item in filter(None, text.split(",")):
        name, sep, file = item.partition("=")
        fmt = LLAMA_NAMES.get(name.lower(), name)
        if not sep or fmt not in OUR_FORMATS:
            raise ValueError(
                f"--gguf {item!r}: NAME=FILE with NAME in {OUR_FORMATS} or {LLAMA_NAMES}"
            )
        if fmt not in formats:
            raise ValueError(f"--gguf {item!r}: its format {fmt} is not in --formats")
        out.append((name, fmt, file))
    return out


def error_line(lines: list[str]) -> str:
    """A failed server's own error line: the first of `lines` (its log's last lines) that says
    "error" in any case (llama.cpp logs the cause first, then "failed to load model" and
    "exiting due to model loading error"), else the last line; "(no output)" for none."""
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[-1] if lines else "(no output)"


def log_lines(log: Path, n: int = ERROR_SEARCH) -> list[str]:
    """The last `n` non-empty lines of a server's log, stripped (none if it was never written)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()][-n:]


def llama_failure(name: str, file: str, stage: str, log: Path, exc: Exception) -> dict:
    """The note of a GGUF whose llama-server failed at `stage` ("start": it exited or never
    answered /health; "waves": it failed while measured): its error line and its log's last
    `LOG_TAIL` lines (the exception's text where the log has none)."""
    lines = log_lines(log) or [ln for ln in str(exc).splitlines() if ln.strip()][-ERROR_SEARCH:]
    return {"gguf": name, "file": file, "stage": stage, "error": error_line(lines),
            "log_tail": lines[-LOG_TAIL:], "log": str(log)}  # fmt: skip


def llama_points(
    args: argparse.Namespace,
    path: Path,
    conc: list[int],
    make_row: Callable[[str, str, int, float, str, float | None], dict],
    probe: Callable[[], float] | None = None,
) -> tuple[list[dict], list[dict]]:
    """llama.cpp's rows and failures. Rows: each GGUF served by llama-server, its HTTP output
    tok/s at each C (median of `--llama-rounds` waves) made a row by `make_row(who, format, C,
    step seconds, ceiling kind, read bandwidth beside)` (the caller's: our bytes and FLOPs per
    token of its format), beside the median of `probe()`'s read bandwidths taken right after its
    waves (None: no probe). A GGUF whose server fails to start or during its waves
    (RuntimeError) has no rows but one `llama_failure` note, and the next GGUF goes on."""
    from benchmarks import cpu_tables, llama_cpp  # the HTTP client: the bench extra

    ggufs = parse_gguf(args.gguf, args.formats.split(","))
    argv = [
        "--model-path", str(path), "--ours", "float32", "--llama-server", args.llama_server,
        "--gguf", ",".join(f"{n}={f}" for n, _, f in ggufs), "--concurrency", args.concurrency,
        "--num-prompts-factor", str(args.num_prompts_factor), "--prompt-len",
        str(args.prompt_len), "--output-len", str(args.output_len), "--threads", str(args.threads),
    ]  # fmt: skip
    ns = llama_cpp.parse_args(argv)
    port = cpu_tables._free_port()
    cmds = llama_cpp.commands(ns, port)  # ours too, unused: only the llama-server lines
    logs = Path(tempfile.mkdtemp(prefix="roofline_llama_"))
    rows, failures = [], []
    for name, fmt, file in ggufs:
        runs: dict[int, list[float]] = {c: [] for c in conc}
        beside: dict[int, list[float]] = {c: [] for c in conc}
        log = logs / f"{name}.log"
        failure = None
        for r in range(args.llama_rounds):
            with ExitStack() as stack:
                try:
                    url = stack.enter_context(cpu_tables.launched(cmds[f"llama {name}"], port, log))
                except RuntimeError as e:
                    failure = llama_failure(name, file, "start", log, e)
                    break
                try:
                    for c in conc:
                        with redirect_stdout(io.StringIO()):  # the wave's own serving report
                            runs[c].append(llama_cpp.wave(url, ns, c, seed=r))
                        logger.info("llama.cpp %s C=%d: %.1f tok/s", name, c, runs[c][-1])
                        if probe:
                            beside[c].append(probe())
                except RuntimeError as e:
                    failure = llama_failure(name, file, "waves", log, e)
                    break
        if failure:
            logger.warning("llama.cpp %s failed (%s): %s", name, failure["stage"],
                           failure["error"])  # fmt: skip
            failures.append(failure)
            continue
        for c in conc:
            tok_s = statistics.median(runs[c])
            row = make_row(f"llama.cpp {name}", fmt, c, c / tok_s, LLAMA_CEILING[fmt],
                           statistics.median(beside[c]) if beside[c] else None)  # fmt: skip
            rows.append(row | {"tok_s_runs": runs[c], "gguf": name})
    return rows, failures
