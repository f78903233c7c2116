from __future__ import annotations

import os

import pytest
import torch

# transformers must never reach a hub from the test suite.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without CUDA, Triton kernels can only be tested in triton's interpreter, which must be chosen
# before triton is first imported. Nothing else in the suite runs Triton on CPU (a CPU model's
# kernel set is the C++ or torch one unless forced), so this changes no other test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one thread is as fast and does not collapse when the machine is shared.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def triton_device() -> torch.device:
    """Where Triton kernels under test run: CUDA when present, else CPU tensors in triton's
    interpreter (enabled above). Skips when triton does not import."""
    from hybrid_serve.kernels.kernel_set import interpreter_ready, triton_available

    if not triton_available():
        pytest.skip("triton is not importable, so the Triton kernels cannot be tested")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not interpreter_ready():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: no CPU interpreter")
    return torch.device("cpu")


@pytest.fixture
def kernels_mode(monkeypatch):
    """`kernels_mode("torch")` sets HYBRID_SERVE_KERNELS for this test (models loaded after it
    choose their kernels by it); `kernels_mode("torch", model)` also gives that loaded model
    the chosen kernel set (`Qwen3NextForCausalLM.use_kernels`)."""
    from hybrid_serve.kernels import choose
    from hybrid_serve.kernels.settings import KERNELS_ENV

    def set_mode(mode: str, model=None) -> None:
        monkeypatch.setenv(KERNELS_ENV, mode)
        if model is not None:
            weight = model.lm_head.weight
            act = torch.float32 if weight.device.type == "cpu" else weight.dtype
            model.use_kernels(choose(weight.device, act))

    yield set_mode


@pytest.fixture
def slow_path_warnings(monkeypatch, caplog):
    """A process that has warned about no slow path yet (`kernels.slow_paths`: the set of keys
    warned about is emptied for this test), and `count(text)`: how many WARNING records logged
    since contain `text`."""
    import logging

    from hybrid_serve.kernels import slow_paths

    monkeypatch.setattr(slow_paths, "_seen", set())
    caplog.set_level(logging.WARNING)

    def count(text: str) -> int:
        return sum(r.levelno == logging.WARNING and text in r.getMessage() for r in caplog.records)

    return count
