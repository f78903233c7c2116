"""The server's command line is generated from the three config dataclasses with SGLang's names."""

from __future__ import annotations

from dataclasses import fields

import pytest

from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.model_runner import RunnerConfig
from hybrid_serve.server.args import ServerConfig, build_serve_parser
from tests.serve_args import parse_serve_args


def test_every_field_has_a_flag():
    option_strings = {s for a in build_serve_parser()._actions for s in a.option_strings}
    for cls in (ServerConfig, RunnerConfig, SchedulerConfig):
        for f in fields(cls):
            assert f"--{f.name.replace('_', '-')}" in option_strings


def test_defaults_equal_the_dataclasses():
    assert parse_serve_args([]) == (ServerConfig(), RunnerConfig(), SchedulerConfig())


def test_sglang_flags():
    server, runner, sched = parse_serve_args(
        [
            "--model-path", "/m", "--host", "0.0.0.0", "--port", "8000", "--api-key", "k",
            "--served-model-name", "m", "--context-length", "1024", "--max-running-requests", "8",
            "--max-total-tokens", "4096", "--max-mamba-cache-size", "40",
            "--chunked-prefill-size", "128", "--schedule-policy", "lpm", "--disable-radix-cache",
            "--mamba-scheduler-strategy", "no_buffer", "--cuda-graph-bs", "1", "2", "4",
        ]
    )  # fmt: skip
    assert server == ServerConfig("/m", "0.0.0.0", 8000, "k", "m")
    assert runner.max_context_len == 1024 and runner.max_running_requests == 8
    assert runner.max_total_tokens == 4096 and runner.mamba_cache_size == 40
    assert sched.chunked_prefill_size == 128 and sched.schedule_policy == "lpm"
    assert sched.disable_radix_cache and sched.cuda_graph_bs == (1, 2, 4)


@pytest.mark.parametrize(
    "argv",
    [
        ["--schedule-policy", "nope"],
        ["--port", "70000"],
        ["--log-level", "loud"],
        # issue 13: these parsed and then failed inside the spawned scheduler process
        ["--max-running-requests", "0"],
        ["--max-total-tokens", "-5"],
        ["--device", "tpu"],
        ["--dtype", "int8"],
        ["--context-length", "1"],
        ["--page-size", "0"],
        ["--mamba-cache-size", "-1"],
        ["--schedule-conservativeness", "0"],
    ],
)
def test_bad_values_raise(argv):
    with pytest.raises(ValueError, match=argv[0]):
        parse_serve_args(argv)


def test_bad_config_is_one_error_line_before_anything_starts(capsys):
    from hybrid_serve.server.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model-path", "/nowhere", "--max-running-requests", "0", "--device", "tpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "hybrid-serve: error: --max-running-requests must be >= 1, got 0"


def test_offline_subcommands_still_work(tmp_path):
    from hybrid_serve.server.cli import main

    main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "m")])
    assert (tmp_path / "m" / "config.json").is_file()
    with pytest.raises(SystemExit) as e:
        main(["--port", "-1"])
    assert e.value.code == 2


def test_generate_takes_the_runner_configs_flags():
    """`generate`'s engine flags are RunnerConfig's fields (every dtype and load format it
    knows), but for the three sizes the command sets for its one request."""
    from hybrid_serve.server.args import config_values
    from hybrid_serve.server.cli import GENERATE_SIZES, build_parser

    args = build_parser().parse_args(
        ["generate", "--dtype", "float16", "--load-format", "safetensors"]
    )
    runner = config_values(args, RunnerConfig)
    assert runner["dtype"] == "float16" and runner["load_format"] == "safetensors"
    assert set(runner) == {f.name for f in fields(RunnerConfig)} - set(GENERATE_SIZES)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-total-tokens", "5"])
