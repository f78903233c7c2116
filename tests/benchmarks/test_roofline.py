"""`benchmarks.roofline`: the arithmetic (fractions, intensity, bytes and FLOPs per token of the
tiny preset against hand counts from its config), the command line end to end on the tiny
preset, the JSON it writes, the plot (or the one-line error without matplotlib), and the
llama.cpp rows (absent without the flags; with them, against a fake server; a llama-server
that fails to start or during its waves is a note, our rows written before it starts). Nothing here
depends on this CPU's speed or ISA: rates are only checked to be positive where measured."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pytest

from benchmarks import roofline, roofline_llama, roofline_peaks
from benchmarks.roofline_peaks import Ceiling
from hybrid_serve.make_model.presets import PRESETS
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.step_bytes import decode_step_bytes
from tests.benchmarks.fake_openai_server import FakeOpenAIServer

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


# ---- the arithmetic -------------------------------------------------------------------------
def costs(**kw) -> roofline.ModelCosts:
    base = dict(
        dense_bytes=1000, dense_params=250, embedding_row_bytes=10, expert_bytes=100.0,
        expert_params=25.0, moe_layers=0, num_experts=0, top_k=0, kv_bytes_per_token=8,
        attention_layers=1, attention_width=2, state_bytes=50, state_flops=30,
    )  # fmt: skip
    return roofline.ModelCosts(**(base | kw))


def ceilings(bw: float | None = 1e9, fp32: float | None = 1e10) -> dict[str, Ceiling]:
    out = {"read_bandwidth": Ceiling("read bandwidth", "", bw, "B/s")}
    for kind, rate in (("fp32_fma", fp32), ("bf16_dot", None), ("int8_dot", 4e10)):
        out[kind] = Ceiling(kind, "", rate, "op/s")
    return out


def test_fraction_and_intensity_of_one_row():
    c = costs()
    # C=2, context 3: weights 1000 + 2 x 10, kv 2 x 3 x 8, state 2 x 2 x 50
    # FLOPs 2 x 2 x 250 (products) + 2 x 4 x 1 x 2 x (3 + 1) (attention) + 2 x 30 (state)
    row = roofline.roofline_row("ours", "float32", 2, 0.5, c, 3, ceilings(), "fp32_fma")
    step_bytes, step_flops = 1020 + 48 + 200, 1000 + 64 + 60
    assert row["bytes_per_step"]["total"] == step_bytes
    assert row["bytes_per_step"]["kv"] == 48 and row["bytes_per_step"]["state"] == 200
    assert row["flops_per_step"] == {
        "matmul": 1000.0, "attention": 64.0, "state": 60.0, "total": step_flops
    }  # fmt: skip
    assert row["tok_s"] == 4.0 and row["step_ms"] == 500.0
    assert row["bytes_per_token"] == step_bytes / 2
    assert row["flops_per_token"] == step_flops / 2
    assert row["intensity"] == pytest.approx(step_flops / step_bytes)
    assert row["bandwidth"] == step_bytes / 0.5
    assert row["bandwidth_fraction"] == pytest.approx(step_bytes / 0.5 / 1e9)
    assert row["read_bandwidth_beside"] is None  # no probe beside it: the start's ceiling
    beside = roofline.roofline_row("ours", "float32", 2, 0.5, c, 3, ceilings(), "fp32_fma",
                                   read_bw=4e9)  # fmt: skip
    assert beside["read_bandwidth_beside"] == 4e9
    assert beside["bandwidth_fraction"] == pytest.approx(step_bytes / 0.5 / 4e9)
    assert row["flop_s"] == step_flops / 0.5
    assert row["ceiling"] == "fp32_fma"
    assert row["ceiling_fraction"] == pytest.approx(step_flops / 0.5 / 1e10)
    unmeasured = roofline.roofline_row("ours", "bfloat16", 2, 0.5, c, 3, ceilings(), "bf16_dot")
    assert unmeasured["ceiling_fraction"] is None
    assert roofline.fraction(3.0, None) is None and roofline.fraction(3.0, 0.0) is None
    assert roofline.fraction(3.0, 4.0) == 0.75


def test_expected_routed_experts_in_the_weights():
    c = costs(moe_layers=2, num_experts=4, top_k=2)
    one = roofline.decode_bytes(c, 1, 0)  # one token: exactly its top-2 experts per layer
    assert one.weights == 1000 + 10 + 2 * 2 * 100
    many = roofline.decode_bytes(c, 1000, 0)  # a large batch touches every expert
    assert many.weights == pytest.approx(1000 + 1000 * 10 + 2 * 4 * 100)
    flops = roofline.decode_flops(c, 3, 0)  # per token: dense + top-2 of each of 2 layers
    assert flops.matmul == 2 * 3 * (250 + 2 * 2 * 25)


def test_ceiling_kind_follows_the_products_by_rows():
    kind = roofline.ceiling_kind
    assert kind("float32", 1, "cpp", True) == "fp32_fma"
    assert kind("bfloat16", 1, "cpp", True) == "bf16_dot"  # the bf16 route at every row count
    assert kind("bfloat16", 16, "cpp", True) == "bf16_dot"
    assert kind("bfloat16", 1, "cpp", False) == "fp32_fma"
    assert kind("bfloat16", 64, "cpp", False) == "fp32_fma"
    assert kind("int8", 8, "cpp", False) == "int8_dot"
    assert kind("int4", 64, "cpp", False) == "int8_dot"  # qgemm.h past the GEMV's rows
    assert kind("int8", 1, "torch", False) == "fp32_fma"


# ---- bytes and FLOPs of the tiny preset, by hand --------------------------------------------
def hand_counts(matrix, keep_float: int, small: int) -> dict:
    """The tiny preset's decode costs from its config: `matrix(N, K)` the stored bytes of a
    product's matrix, `keep_float` bytes per router value, `small` per norm/conv/... value."""
    c = PRESETS["tiny"]
    h, vocab, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    attn = layers // c["full_attention_interval"]
    lin = layers - attn
    hq, hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, kc = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    e, k, inter, shared = (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
                           c["shared_expert_intermediate_size"])  # fmt: skip
    conv_dim = 2 * hk * dk + hv * dv
    gdn_mats = [(2 * hk * dk + 2 * hv * dv, h), (2 * hv, h), (h, hv * dv)]
    gdn_small = conv_dim * kc + 2 * hv + dv  # conv1d, dt_bias and A_log, gated norm
    attn_mats = [(2 * hq * d, h), (hkv * d, h), (hkv * d, h), (h, hq * d)]
    attn_small = 2 * d  # q_norm, k_norm
    moe_mats = [(shared, h), (shared, h), (h, shared)]
    moe_float = e * h + h  # router, shared-expert gate
    layer_small = 2 * h  # input and post-attention norms
    expert_mats = [(2 * inter, h), (h, inter)]

    def size(mats):
        return sum(matrix(n, kk) for n, kk in mats)

    def count(mats):
        return sum(n * kk for n, kk in mats)

    dense_bytes = (
        lin * (size(gdn_mats) + gdn_small * small)
        + attn * (size(attn_mats) + attn_small * small)
        + layers * (size(moe_mats) + moe_float * keep_float + layer_small * small)
        + h * small  # final norm
        + matrix(vocab, h)  # LM head (untied)
    )
    dense_params = (
        lin * (count(gdn_mats) + gdn_small)
        + attn * (count(attn_mats) + attn_small)
        + layers * (count(moe_mats) + moe_float + layer_small)
        + h
        + vocab * h
    )
    return {
        "dense_bytes": dense_bytes,
        "dense_params": dense_params,
        "expert_bytes": size(expert_mats),
        "expert_params": count(expert_mats),
        "moe_layers": layers,
        "num_experts": e,
        "top_k": k,
        "attention_layers": attn,
        "attention_width": hq * d,
        "kv_per_token_values": attn * 2 * hkv * d,
        "state_values": (lin * conv_dim * (kc - 1), lin * hv * dk * dv),  # conv, recurrent
        "state_flops": lin * hv * dk * dv * 7,  # Gated DeltaNet: 7 per state element
        "embedding_row_values": h,
    }


@pytest.fixture(scope="module")
def runners(tiny_ckpt: Path) -> dict:
    return {fmt: roofline.load_format(tiny_ckpt, fmt, 4, 16, "auto") for fmt in ("float32", "int8")}


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_tiny_costs_by_hand(runners, tiny_ckpt: Path, fmt: str):
    runner = runners[fmt]
    got = roofline.model_costs(runner.model, runner.kv_pool, runner.mamba_pool)
    if fmt == "float32":
        hand = hand_counts(lambda n, k: 4 * n * k, 4, 4)
    else:  # int8 rows: K values then a 4-byte scale; routers kept bf16; the rest fp32
        hand = hand_counts(lambda n, k: n * (k + 4), 2, 4)
    kv_size = runner.kv_pool.dtype.itemsize
    conv_size = runner.mamba_pool.conv_dtype.itemsize
    ssm_size = runner.mamba_pool.ssm_dtype.itemsize
    assert got.dense_bytes == hand["dense_bytes"]
    assert got.dense_params == hand["dense_params"]
    assert got.expert_bytes == hand["expert_bytes"] and got.expert_params == hand["expert_params"]
    assert (got.moe_layers, got.num_experts, got.top_k) == (8, 4, 2) == (
        hand["moe_layers"], hand["num_experts"], hand["top_k"])  # fmt: skip
    assert got.embedding_row_bytes == 4 * hand["embedding_row_values"]  # the table stays fp32
    assert got.kv_bytes_per_token == hand["kv_per_token_values"] * kv_size
    conv, ssm = hand["state_values"]
    assert got.state_bytes == conv * conv_size + ssm * ssm_size
    assert got.state_flops == hand["state_flops"]

    batch, context = 4, 16
    step = roofline.decode_bytes(got, batch, context)
    touched = hand["num_experts"] * (1 - (1 - hand["top_k"] / hand["num_experts"]) ** batch)
    weights = (hand["dense_bytes"] + batch * 4 * hand["embedding_row_values"]
               + hand["moe_layers"] * touched * hand["expert_bytes"])  # fmt: skip
    assert step.weights == pytest.approx(weights)
    assert step.kv == batch * context * hand["kv_per_token_values"] * kv_size
    assert step.state == 2 * batch * (conv * conv_size + ssm * ssm_size)
    flops = roofline.decode_flops(got, batch, context)
    per_token = (
        2 * (hand["dense_params"] + hand["moe_layers"] * hand["top_k"] * hand["expert_params"])
        + 4 * hand["attention_layers"] * hand["attention_width"] * (context + 1)
        + hand["state_flops"]
    )
    assert flops.total / batch == per_token
    if fmt == "float32":  # one weight dtype and fp32 caches: step_bytes' own count agrees
        config = Qwen3NextConfig.from_dict(json.loads((tiny_ckpt / "config.json").read_text()))
        assert step.total == pytest.approx(decode_step_bytes(config, batch, context, 4, 4).total)


# ---- the command line -----------------------------------------------------------------------
FAST = "--repeats 1 --warmup 1 --bandwidth-mib 8 --probe-seconds 0.001 --context-len 8"


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("roofline")
    argv = f"--preset tiny --concurrency 1,4 --formats float32,int8 {FAST} --threads 1".split()
    argv += ["--json-out", str(out / "r.json")]
    if HAS_MPL:
        argv += ["--plot", str(out / "r.png")]
    buf = io.StringIO()
    with redirect_stdout(buf):
        report = roofline.main(argv)
    return {"report": report, "dir": out, "stdout": buf.getvalue()}


def test_cli_end_to_end_writes_the_json(cli_run: dict):
    report = cli_run["report"]
    written = json.loads((cli_run["dir"] / "r.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert set(written) == {
        "args", "host", "ceilings", "model", "ours", "llama_cpp", "llama_cpp_note",
        "llama_cpp_failures",
    }  # fmt: skip
    assert list(written["ceilings"]) == ["read_bandwidth", *roofline_peaks.KINDS]
    for c in written["ceilings"].values():
        assert set(c) == {"name", "what", "rate", "unit", "runs", "note"}
        assert c["rate"] is None or c["rate"] > 0
        assert c["rate"] is not None or c["note"].startswith("not measured")
    assert written["ceilings"]["read_bandwidth"]["rate"] > 0
    assert written["model"]["preset"] == "tiny" and written["model"]["context_len"] == 8
    assert set(written["model"]["costs"]) == {"float32", "int8"}
    rows = written["ours"]
    assert [(r["format"], r["concurrency"]) for r in rows] == [
        ("float32", 1), ("float32", 4), ("int8", 1), ("int8", 4)
    ]  # fmt: skip
    for r in rows:
        assert r["who"] == "ours" and r["step_path"] in ("plan", "eager")
        assert r["tok_s"] > 0 and len(r["step_s_runs"]) == 1
        assert r["intensity"] == pytest.approx(r["flops_per_token"] / r["bytes_per_token"])
        assert r["read_bandwidth_beside"] > 0  # probed right after the row's steps
        assert r["bandwidth_fraction"] == pytest.approx(r["bandwidth"] / r["read_bandwidth_beside"])
        assert r["ceiling"] in roofline_peaks.KINDS
        rate = written["ceilings"][r["ceiling"]]["rate"]
        assert r["ceiling_fraction"] == (
            None if rate is None else pytest.approx(r["flop_s"] / rate)
        )
    # int8 stores about a quarter of float32's matrix bytes: fewer bytes per token, same FLOPs
    f32, i8 = rows[0], rows[2]
    assert i8["bytes_per_token"] < f32["bytes_per_token"]
    assert i8["flops_per_token"] == f32["flops_per_token"]
    assert "| ours | int8 | 4 |" in cli_run["stdout"]


def test_llama_rows_absent_without_the_flags(cli_run: dict):
    assert cli_run["report"]["llama_cpp"] == []
    assert cli_run["report"]["llama_cpp_note"] == roofline_llama.NO_LLAMA
    assert cli_run["report"]["llama_cpp_failures"] == []
    assert f"llama.cpp: {roofline_llama.NO_LLAMA}" in cli_run["stdout"]
    assert "| llama.cpp" not in cli_run["stdout"]


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib (the bench extra) is not installed")
def test_plot_written(cli_run: dict):
    png = (cli_run["dir"] / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_plot_without_matplotlib_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        roofline.parse_args(["--preset", "tiny", "--plot", "x.png"])
    message = str(e.value.code)
    assert message == roofline.PLOT_NEEDS and "\n" not in message
    assert "pip install matplotlib" in message


def test_flag_errors(capsys):
    for argv in (
        ["--llama-server", "/bin/true"],  # no --gguf
        ["--gguf", "q8_0=m.gguf"],  # no --llama-server
        ["--llama-server", "/bin/true", "--gguf", "q8_0=m.gguf", "--formats", "float32"],
        ["--llama-server", "/bin/true", "--gguf", "q5_k=m.gguf"],
        ["--formats", "float16"],
        ["--concurrency", "0,4"],
    ):
        with pytest.raises(SystemExit) as e:
            roofline.parse_args(argv)
        assert e.value.code == 2, argv
    formats = ["bfloat16", "int8", "int4"]
    parsed = roofline_llama.parse_gguf("q8_0=a.gguf,bf16=b.gguf,int4=c", formats)
    assert parsed == [
        ("q8_0", "int8", "a.gguf"), ("bf16", "bfloat16", "b.gguf"), ("int4", "int4", "c")
    ]  # fmt: skip


def test_llama_rows_at_our_bytes_and_flops(monkeypatch, tmp_path: Path, capsys):
    """With the flags, each GGUF's waves run against its server (here a fake OpenAI server in
    place of llama-server) and its rows sit at our bytes and FLOPs per token of its format."""
    from benchmarks import cpu_tables

    started: list[list[str]] = []

    @contextmanager
    def fake_launched(cmd: list[str], port: int, log: Path):
        started.append(cmd)
        with FakeOpenAIServer() as server:
            yield server.url

    monkeypatch.setattr(cpu_tables, "launched", fake_launched)
    argv = f"--preset tiny --concurrency 1,2 --formats int8 {FAST} --threads 1".split()
    argv += ["--llama-server", "/opt/llama/llama-server", "--gguf", "q8_0=/m/m-Q8_0.gguf"]
    argv += "--prompt-len 4 --output-len 3 --num-prompts-factor 1".split()
    report = roofline.main(argv)
    assert len(started) == 1 and started[0][:3] == [
        "/opt/llama/llama-server",
        "-m",
        "/m/m-Q8_0.gguf",
    ]
    llama = report["llama_cpp"]
    assert [(r["who"], r["format"], r["concurrency"]) for r in llama] == [
        ("llama.cpp q8_0", "int8", 1), ("llama.cpp q8_0", "int8", 2)
    ]  # fmt: skip
    for ours, theirs in zip(report["ours"], llama, strict=True):
        assert theirs["bytes_per_token"] == ours["bytes_per_token"]
        assert theirs["flops_per_token"] == ours["flops_per_token"]
        assert theirs["tok_s"] > 0 and math.isclose(theirs["tok_s"], theirs["tok_s_runs"][0])
        assert theirs["read_bandwidth_beside"] > 0  # probed after its wave
    assert len(roofline.read_bandwidths(report)) == 1 + 2 * 2  # the start, then every row's
    out = capsys.readouterr().out
    assert "| llama.cpp q8_0 | int8 | 2 | HTTP |" in out and "llama.cpp: absent" not in out


REPO = Path(__file__).resolve().parents[2]
# a llama-server that cannot load its GGUF: it says what it saw of our JSON, then llama.cpp's own
# lines for a refused GGUF, and exits 1
FAKE_LLAMA = """#!{python}
import json, os, sys
report = json.loads(open(os.environ["ROOFLINE_TEST_JSON"]).read())
print(f"fake: our rows before me: {{len(report['ours'])}}, note: {{report['llama_cpp_note']}}",
      flush=True)
print("E llama_model_load: error loading model: check_tensor_dims: tensor 'blk.1.ssm_in.weight'"
      " not found", file=sys.stderr)
print("E llama_model_load_from_file_impl: failed to load model", file=sys.stderr)
print("E srv  llama_server: exiting due to model loading error", file=sys.stderr)
sys.exit(1)
"""
REFUSAL = (
    "E llama_model_load: error loading model: check_tensor_dims: tensor 'blk.1.ssm_in.weight'"
    " not found"
)


def test_a_llama_server_that_fails_to_start_keeps_our_rows(tmp_path: Path):
    """The command line end to end with a llama-server that exits 1 on load: our rows are
    printed and written before it starts (it reads them from the JSON), its failure becomes a
    note with llama.cpp's error line, and the run exits 0."""
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "r.json"
    argv = f"--preset tiny --concurrency 1 --formats float32 {FAST} --threads 1".split()
    argv += ["--llama-server", str(fake), "--gguf", f"f32={tmp_path / 'm-f32.gguf'}"]
    argv += ["--json-out", str(out)] + (["--plot", str(tmp_path / "r.png")] if HAS_MPL else [])
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "ROOFLINE_TEST_JSON": str(out)}
    run = subprocess.run([sys.executable, "-m", "benchmarks.roofline", *argv], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["who"], r["format"], r["concurrency"]) for r in report["ours"]] == [
        ("ours", "float32", 1)
    ]
    assert report["llama_cpp"] == [] and report["llama_cpp_note"].startswith("no rows")
    (failure,) = report["llama_cpp_failures"]
    assert failure["gguf"] == "f32" and failure["stage"] == "start"
    assert failure["error"] == REFUSAL
    assert failure["log_tail"][-1].endswith("exiting due to model loading error")
    # what the server saw: our row already in the JSON, llama.cpp's still pending
    pending = roofline_llama.LLAMA_PENDING
    assert f"fake: our rows before me: 1, note: {pending}" in failure["log_tail"]
    stdout = run.stdout
    assert stdout.index("| ours | float32 | 1 |") < stdout.index("llama.cpp f32 (")
    assert f"llama-server failed to start: {REFUSAL}" in stdout
    if HAS_MPL:
        assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_llama_server_failing_in_its_waves_is_a_note_and_the_next_gguf_goes_on(
    monkeypatch, tmp_path: Path, capsys
):
    """Two GGUFs: the first's server dies during its wave (its log says why), the second's
    answers; the first is a note, the second has its rows, ours are kept."""
    from benchmarks import cpu_tables, llama_cpp

    @contextmanager
    def fake_launched(cmd: list[str], port: int, log: Path):
        with FakeOpenAIServer() as server:
            log.write_text("ggml: illegal instruction\n" if "bad.gguf" in cmd else "ok\n")
            yield "dead" if "bad.gguf" in cmd else server.url

    real_wave = llama_cpp.wave

    def wave(url, args, c, seed):
        if url == "dead":
            raise RuntimeError("wave at concurrency 1: [connection refused]")
        return real_wave(url, args, c, seed)

    monkeypatch.setattr(cpu_tables, "launched", fake_launched)
    monkeypatch.setattr(llama_cpp, "wave", wave)
    argv = f"--preset tiny --concurrency 1 --formats int8 {FAST} --threads 1".split()
    argv += ["--llama-server", "/opt/llama/llama-server", "--gguf", "q8_0=bad.gguf,int8=ok.gguf"]
    argv += "--prompt-len 4 --output-len 3 --num-prompts-factor 1".split()
    report = roofline.main(argv)
    assert [r["who"] for r in report["ours"]] == ["ours"]
    assert [r["who"] for r in report["llama_cpp"]] == ["llama.cpp int8"]
    assert report["llama_cpp_note"] == roofline_llama.LLAMA_MEASURED
    (failure,) = report["llama_cpp_failures"]
    assert (failure["gguf"], failure["file"], failure["stage"]) == ("q8_0", "bad.gguf", "waves")
    assert failure["error"] == "ggml: illegal instruction"  # no "error" line: the last one
    out = capsys.readouterr().out
    assert "llama.cpp q8_0 (bad.gguf): llama-server failed during its waves" in out
    assert "| llama.cpp int8 | int8 | 1 | HTTP |" in out


def test_error_line_is_the_cause_not_the_exit():
    lines = ["I load_tensors: ...", REFUSAL, "E failed to load model", "E exiting due to error"]
    assert roofline_llama.error_line(lines) == REFUSAL
    assert roofline_llama.error_line(["a", "b"]) == "b"
    assert roofline_llama.error_line([]) == "(no output)"


def test_peaks_choose_the_widest_probe_the_features_allow():
    names = list(roofline_peaks.PROBES)
    choose = roofline_peaks.choose_probes
    assert choose(names, []) == {"fp32_fma": "fp32_fma:generic", "bf16_dot": None, "int8_dot": None}
    assert choose(names, ["avx2", "fma"]) == {
        "fp32_fma": "fp32_fma:avx2", "bf16_dot": None, "int8_dot": "int8_dot:avx2"
    }  # fmt: skip
    zen4 = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"]
    assert choose(names, zen4) == {
        "fp32_fma": "fp32_fma:avx512",
        "bf16_dot": "bf16_dot:avx512_bf16",
        "int8_dot": "int8_dot:avx512_vnni",
    }
    assert choose(["fp32_fma:generic"], zen4)["int8_dot"] is None  # an aarch64 build


def test_peaks_without_features_measure_the_generic_probe_only():
    peaks = roofline_peaks.measure_peaks(1, 0.001, 1, features=[])
    assert list(peaks) == list(roofline_peaks.KINDS)
    fp32 = peaks["fp32_fma"]
    if fp32.rate is None:  # no C++ compiler here: every peak says why
        assert all(p.note.startswith("not measured") for p in peaks.values())
        return
    assert fp32.rate > 0 and "compiler vectors" in fp32.what and len(fp32.runs) == 1
    for kind in ("bf16_dot", "int8_dot"):
        assert peaks[kind].rate is None and peaks[kind].note.startswith("not measured")


@pytest.mark.parametrize("broken", ["no compiler", "compiler fails"])
def test_peaks_without_a_working_compiler_say_why(monkeypatch, tmp_path: Path, broken: str):
    from hybrid_serve.kernels import cpp_build

    monkeypatch.setenv("HYBRID_SERVE_KERNEL_CACHE", str(tmp_path))
    if broken == "no compiler":

        def missing() -> str:
            raise cpp_build.NoCompiler("no C++ compiler ('c++' is not on PATH)")

        monkeypatch.setattr(cpp_build, "compiler", missing)
    else:
        monkeypatch.setattr(cpp_build, "compiler", lambda: "/bin/false")
    peaks = roofline_peaks.measure_peaks(1, 0.001, 1)
    assert [p.rate for p in peaks.values()] == [None, None, None]
    for p in peaks.values():
        assert p.note.startswith("not measured: ")
        assert ("compiler" if broken == "no compiler" else "failed to build") in p.note
    assert not list(tmp_path.glob("roofline-probe*"))  # nothing half-built left behind
