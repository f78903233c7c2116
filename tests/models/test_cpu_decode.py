"""The CPU decode plan (`models.cpu_decode`): bit for bit the eager decode step, logits and
pools, in fp32 and with bf16, int8 and int4 matrices; where it does not apply; and
`DecodeGraphRunner` using it only for the batches it covers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybrid_serve.kernels import KernelSettings, choose
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models import plan_blocks, plan_builders, plan_refusal
from hybrid_serve.models.cpu_decode import MAX_ROWS, CpuDecodePlan
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from tests.families import FAMILY_PRESETS
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)
from tests.models.plan_harness import PROMPTS, assert_steps_alike, pools, prefilled

PLAN_ROWS = 10  # the runners' largest size below: beyond the GEMV's 8 rows, short of PROMPTS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    """Qwen3.5's dense layout: every layer a plain SwiGLU MLP, gated attention."""
    cfg = preset_config("tiny-qwen3.5")
    return write_checkpoint(tmp_path_factory.mktemp("dense"), cfg, seed=4)


class Counting:
    """Stands in for a runner's plan: runs it, and records the rows of every batch it ran."""

    def __init__(self, plan: CpuDecodePlan) -> None:
        self.plan, self.rows = plan, []

    def ready(self, rows: int) -> bool:
        return self.plan.ready(rows)

    def __call__(self, batch) -> torch.Tensor:
        self.rows.append(batch.num_reqs)
        return self.plan(batch)


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [("moe", "float32"), ("moe", "bfloat16"), ("moe", "int8"), ("moe", "int4"),
     ("dense", "float32"), ("dense", "bfloat16"), ("dense", "int4")],
)  # fmt: skip
def test_plan_equals_eager_bit_for_bit(request, layout, dtype):
    """Greedy steps of 1 to PLAN_ROWS requests (the GEMV's rows and the GEMM's), and one beyond
    (which the runner runs eagerly): identical logits and identical pools after every step, with
    fp32, bf16, int8 and int4 (bf16 checkpoint loading) matrices, sparse-MoE and dense MLPs."""
    ckpt = request.getfixturevalue("ckpt" if layout == "moe" else "dense_ckpt")
    load = ("bfloat16", dtype) if dtype.startswith("int") else (dtype, None)
    eager, slots, first = prefilled(ckpt, *load)
    fast, slots2, first2 = prefilled(ckpt, *load)
    assert slots == slots2 and first == first2
    plain = DecodeGraphRunner(eager, [])  # no sizes: no plan, every batch eager
    planned = DecodeGraphRunner(fast, [1, 2, 4, 8, PLAN_ROWS])
    assert plain.plan is None and planned.plan is not None and planned.plan_rows == PLAN_ROWS
    assert 8 < PLAN_ROWS <= MAX_ROWS  # the GEMV's rows and the tiled GEMM's
    planned.plan = spy = Counting(planned.plan)
    sizes = [1, 3, PLAN_ROWS, 2, len(PROMPTS), 9, 1, 5]
    assert_steps_alike(plain, planned, slots, first, PROMPTS, sizes)
    assert spy.rows == [1, 3, PLAN_ROWS, 2, 9, 1, 5]  # the 12-row step ran eagerly


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_every_family_plan_equals_eager_bit_for_bit(tmp_path_factory, preset, dtype):
    """Each hybrid family's tiny preset (tests/families.py: NemotronH, Granite-4.0-H with and
    without experts, Bamba, Falcon-H1 and its multipliers, OLMo-Hybrid, LFM2's short conv and
    per-head-normed attention, LFM2-MoE's sigmoid-routed experts, LFM3's sliding and full
    attention with their own angles, output gate and sandwich norms, Kimi-Linear's KDA, NoPE
    MLA over the latent rows and grouped-router MoE, Ling-3's full-rank bounded KDA gates, MLA
    with partial RoPE and a head gate, and clamped SwiGLU experts) through the plan: greedy
    steps of 1, 4 and 16 rows (the GEMV's rows and the tiled GEMM's; with bf16 matrices, bf16
    products forced on, the bf16 route's from 16; int8 and int4 matrices quantized from bf16)
    give the eager step's logits and pools bit for bit, and the plan ran every one of them."""
    ckpt = write_checkpoint(tmp_path_factory.mktemp(preset), preset_config(preset), seed=5)
    assert_plan_steps_alike(ckpt, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("changes", [{}, {"use_attention_gate": False, "use_sandwich_norm": False}])
def test_lfm3_plan_equals_eager_over_a_short_window(tmp_path, changes, dtype):
    """LFM3 with a 3-key window, which every prompt longer than 2 tokens runs past (a plan
    that ignored the window would see more keys than the eager step), with and without the
    output gate and the sandwich norms (pre-norm blocks): the plan's logits and pools are the
    eager step's bit for bit."""
    cfg = preset_config("tiny-lfm3") | {"sliding_window": 3} | changes
    assert_plan_steps_alike(write_checkpoint(tmp_path / "lfm3", cfg, seed=6), dtype)


def assert_plan_steps_alike(ckpt, dtype: str) -> None:
    """Greedy steps of 1, 4, 16 and 4 of 24 requests, eager and through the plan (which runs
    every one of them): identical logits and pools."""
    many = PROMPTS + [[t + 1 for t in p] for p in PROMPTS]  # 24 requests
    on = KernelSettings(bf16_products="on")
    load = ("bfloat16", dtype) if dtype.startswith("int") else (dtype, None)
    eager, slots, first = prefilled(ckpt, *load, prompts=many, settings=on)
    fast, slots2, first2 = prefilled(ckpt, *load, prompts=many, settings=on)
    assert slots == slots2 and first == first2
    plain, planned = DecodeGraphRunner(eager, []), DecodeGraphRunner(fast, [1, 4, 16])
    assert plain.plan is None and planned.plan is not None and planned.plan.rows >= 16
    planned.plan = spy = Counting(planned.plan)
    assert_steps_alike(plain, planned, slots, first, many, [1, 4, 16, 4])
    assert spy.rows == [1, 4, 16, 4]


def test_layers_without_a_block_builder_refuse_the_plan_naming_them(
    tmp_path, monkeypatch, slow_path_warnings, caplog
):
    """A model whose layers no block builder describes (stood in for here by LFM2 with its
    builder taken out) gets no plan: one WARNING names its layers' class and that no setting
    avoids it, and decode runs the eager step."""
    ckpt = write_checkpoint(tmp_path / "lfm2", preset_config("tiny-lfm2"), seed=5)
    runner, _, _ = prefilled(ckpt, "float32")
    assert DecodeGraphRunner(runner, [1, 4]).plan is not None
    blocks = {k: v for k, v in plan_builders.BLOCKS.items() if v is not plan_builders.lfm2_blocks}
    monkeypatch.setattr(plan_builders, "BLOCKS", blocks)
    for _ in range(2):
        assert DecodeGraphRunner(runner, [1, 4]).plan is None
    texts = [r.getMessage() for r in caplog.records if "no CPU decode plan" in r.getMessage()]
    assert len(texts) == slow_path_warnings("no CPU decode plan") == 1
    assert "of Lfm2DecoderLayer layers, which no block builder describes" in texts[0]
    assert "no setting avoids it" in texts[0]


@pytest.mark.parametrize("preset", ["tiny-granite-4.0-h", "tiny-lfm2-moe"])
def test_batches_beyond_the_routed_experts_op_run_eagerly(tmp_path, preset):
    """With top-k 8, batches of more than 32 rows route more rows than the routed experts' C++
    op takes (256), where the eager step switches to the reference: the plan's `rows` stop at
    32, and a 33-row step (which the C++ step would refuse) still equals the eager step
    (Granite-4.0-H's softmax router, LFM2-MoE's sigmoid one)."""
    cfg = {**preset_config(preset), "num_experts_per_tok": 8}
    ckpt = write_checkpoint(tmp_path / preset, cfg, seed=6)
    many = PROMPTS * 3  # 36 requests
    eager, slots, first = prefilled(ckpt, "float32", prompts=many)
    fast, _, _ = prefilled(ckpt, "float32", prompts=many)
    plain, planned = DecodeGraphRunner(eager, []), DecodeGraphRunner(fast, [1, 8, 64])
    assert planned.plan.rows == 32 and planned.plan_rows == 64
    assert_steps_alike(plain, planned, slots, first, many, [33, 32])


def test_plan_follows_the_kernel_choice(ckpt, kernels_mode):
    """A model on the torch references (or the C++ kernels without their fusions) does not run
    the fused C++ decode ops, so it gets no plan."""
    runner, slots, first = prefilled(ckpt, "float32")
    assert DecodeGraphRunner(runner, [1, 2]).plan is not None
    kernels_mode("torch", runner.model)
    graphs = DecodeGraphRunner(runner, [1, 2])
    assert graphs.plan is None
    (q, m), n = slots[0], len(PROMPTS[0])
    logits = graphs.forward([DecodeInput(q, m, n, first[0])], runner.alloc_kv(q, n, 1))
    assert logits.shape == (1, runner.model.config.vocab_size)
    runner.model.use_kernels(choose("cpu", settings=KernelSettings(fusions=False)))
    assert DecodeGraphRunner(runner, [1, 2]).plan is None


def test_where_the_plan_does_not_apply(ckpt):
    runner, _, _ = prefilled(ckpt, "float32")
    model, pools_args = runner.model, (runner.kv_pool, runner.mamba_pool,
                                       runner.req_pool.req_to_token)  # fmt: skip
    assert plan_refusal.unsupported(model) is None
    assert DecodeGraphRunner(runner, []).plan is None  # --disable-cuda-graph: no sizes
    head = model.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    assert plan_refusal.unsupported(model) == "a bias (lm_head.bias)"
    head.bias = None
    norm = model.model.norm
    norm.weight.data = norm.weight.data.to(torch.bfloat16)
    assert plan_refusal.unsupported(model) == "model.norm.weight is torch.bfloat16"
    norm.weight.data = norm.weight.data.float()
    kv = runner.kv_pool
    bf16_kv = SimpleNamespace(k_all=kv.k_all.to(torch.bfloat16), v_all=kv.v_all)
    bf16_args = (bf16_kv, *pools_args[1:])
    assert plan_refusal.pools_unsupported(*bf16_args) == "the K pool is torch.bfloat16"
    assert CpuDecodePlan.build(model, *bf16_args) is None
    assert CpuDecodePlan.build(model, *pools_args) is not None


def test_a_refused_plan_warns_once_with_what_would_let_it_apply(
    ckpt, kernels_mode, slow_path_warnings, caplog
):
    """Where the plan does not apply, start-up logs one WARNING per process and reason that
    names why and the setting that would let it apply (or that none would); a model and pools
    it applies to log none."""
    runner, _, _ = prefilled(ckpt, "float32")
    model = runner.model
    kv, mamba, req_to_token = runner.kv_pool, runner.mamba_pool, runner.req_pool.req_to_token
    assert DecodeGraphRunner(runner, [1, 2]).plan is not None
    assert slow_path_warnings("no CPU decode plan") == 0
    model.use_kernels(choose("cpu", settings=KernelSettings(fusions=False)))
    for _ in range(2):
        assert DecodeGraphRunner(runner, [1, 2]).plan is None
    kernels_mode("torch", model)
    assert DecodeGraphRunner(runner, [1, 2]).plan is None
    model.use_kernels(choose("cpu", settings=KernelSettings()))
    bf16_states = SimpleNamespace(conv_state=mamba.conv_state,
                                  ssm_state=mamba.ssm_state.to(torch.bfloat16))  # fmt: skip
    head = model.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    for _ in range(2):
        assert CpuDecodePlan.build(model, kv, bf16_states, req_to_token) is None
    head.bias = None
    for _ in range(2):
        assert CpuDecodePlan.build(model, kv, bf16_states, req_to_token) is None
    assert CpuDecodePlan.build(model, kv, mamba, req_to_token) is not None
    texts = [r.getMessage() for r in caplog.records if "no CPU decode plan" in r.getMessage()]
    assert len(texts) == slow_path_warnings("no CPU decode plan") == 4
    fusions, torch_set, bias, states = texts
    assert "the cpp kernels without fusions" in fusions and "HYBRID_SERVE_FUSIONS=on" in fusions
    assert "the torch kernels" in torch_set and "HYBRID_SERVE_KERNELS=auto or cpp" in torch_set
    assert "a bias (lm_head.bias)" in bias and "no setting avoids it" in bias
    assert "the SSM pool is torch.bfloat16" in states and "--mamba-ssm-dtype float32" in states
    assert all("decode batches run the eager step" in t for t in texts)


def test_block_step_checks_its_layout(ckpt):
    """`BlockStep` takes the flat lists `CpuDecodePlan` writes; lists of the wrong length, kinds
    it has no layout for (past the last mixer and MLP kinds) and deferred-residual blocks mixed
    with others are refused when it is built, not read past when it runs."""
    model = load_model(ckpt, dtype="float32")
    norm, head = model.model.norm.weight, model.lm_head.weight
    step = torch.classes.hybrid_serve.BlockStep
    relu2 = [plan_blocks.PRE, plan_blocks.NO_MIXER, plan_blocks.RELU2]
    step([norm] * 3, relu2, [1e-6], norm, 1e-6, head, False)  # norm, up, down: the layout
    with pytest.raises(RuntimeError, match="too few ints"):
        step([norm] * 3, relu2[:2], [1e-6], norm, 1e-6, head, False)
    with pytest.raises(RuntimeError, match="too few tensors"):
        step([norm] * 2, relu2, [1e-6], norm, 1e-6, head, False)
    with pytest.raises(RuntimeError, match="1 tensors, 0 ints and 1 floats left over"):
        step([norm] * 4, relu2, [1e-6] * 2, norm, 1e-6, head, False)
    with pytest.raises(RuntimeError, match="mixer kind 9"):
        step([norm] * 3, [plan_blocks.PRE, plan_blocks.MLA + 1, 0], [], norm, 1e-6, head, False)
    with pytest.raises(RuntimeError, match="MLP kind 8"):
        step([norm] * 3, [plan_blocks.PRE, 0, plan_blocks.GROUPED_MOE + 1], [], norm, 1e-6, head,
             False)  # fmt: skip
    deferred = [plan_blocks.DEFERRED, *relu2[1:]]
    with pytest.raises(RuntimeError, match="deferred-residual blocks mixed with others"):
        step([norm] * 6, relu2 + deferred, [1e-6] * 2, norm, 1e-6, head, False)


@pytest.mark.parametrize("layout", ["moe", "dense"])
def test_plan_takes_the_bf16_route_as_the_eager_step(request, layout):
    """With bf16 products at batch (forced on, so on any CPU), steps of 16 rows and more (the
    route's) and of fewer are still the eager step's bit for bit; and the route was taken: the
    prefill's products in bf16 leave other states than the exact products', about as far from
    them as those are from fp32's (random weights amplify every rounding: ~5-10% there)."""
    ckpt = request.getfixturevalue("ckpt" if layout == "moe" else "dense_ckpt")
    many = PROMPTS + [[t + 1 for t in p] for p in PROMPTS]  # 24 requests
    on = KernelSettings(bf16_products="on")
    eager, slots, first = prefilled(ckpt, "bfloat16", prompts=many, settings=on)
    fast, _, first2 = prefilled(ckpt, "bfloat16", prompts=many, settings=on)
    exact, _, _ = prefilled(ckpt, "bfloat16", prompts=many,
                            settings=KernelSettings(bf16_products="off"))  # fmt: skip
    fp32, _, _ = prefilled(ckpt, "float32", prompts=many)
    assert eager.model.ops.bf16_products and not exact.model.ops.bf16_products
    assert first == first2
    for a, b, c in zip(pools(eager), pools(exact), pools(fp32), strict=True):
        assert not torch.equal(a, b)
        assert (a - b).norm() < 3 * (b - c).norm()
    plain, planned = DecodeGraphRunner(eager, []), DecodeGraphRunner(fast, [1, 8, 16, 24])
    assert planned.plan is not None and planned.plan_rows == len(many)
    planned.plan = spy = Counting(planned.plan)
    assert_steps_alike(plain, planned, slots, first, many, [len(many), 16, 15, 20])
    assert spy.rows == [len(many), 16, 15, 20]


@pytest.mark.parametrize("layout", ["moe", "dense"])
def test_plan_verify_equals_the_eager_extend(request, layout):
    """A speculative verify batch (requests with 1 to 4 rows at consecutive positions, step
    slots kept): through the plan (`BlockStep.verify`) as through the model's extend forward,
    logits and hidden within fp32 rounding, the pools (states kept in the step slots too) alike."""
    ckpt = request.getfixturevalue("ckpt" if layout == "moe" else "dense_ckpt")
    eager, slots, first = prefilled(ckpt, "float32")
    fast, _, _ = prefilled(ckpt, "float32")
    plain, planned = DecodeGraphRunner(eager, []), DecodeGraphRunner(fast, [1, 2, 4, 8])
    assert plain.plan is None and planned.plan is not None
    lens = [1, 4, 2, 3]
    outs = []
    for graphs in (plain, planned):
        runner = graphs.runner
        items, locs = [], []
        for i, n in enumerate(lens):
            q, m = slots[i]
            steps = [int(s) for s in runner.mamba_pool.alloc(n - 1)] if n > 1 else []
            ids = [first[i], *range(10, 9 + n)]
            items.append(ExtendInput(q, m, len(PROMPTS[i]), ids, step_slots=steps))
            locs.append(runner.alloc_kv(q, len(PROMPTS[i]), n))
        batch = runner.build_prefill(items, locs, return_all_logits=True, verify=True)
        outs.append(graphs.verify(batch))
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for a, b in zip(pools(eager), pools(fast), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_verify_rows_equal_plain_decode_steps_bit_for_bit(dense_ckpt, dtype):
    """A verify pass of 4 rows of one request through the plan gives each row the logits of the
    plain decode step of the same token at the same position, bit for bit, with fp32, bf16,
    int8 and int4 matrices (no product's row depends on how many rows share the pass: gemv.h,
    qgemv.h), so greedy speculative decoding lands plain decoding's tokens even at near-ties."""
    load = ("bfloat16", dtype) if dtype.startswith("int") else (dtype, None)
    logits = []
    for verify in (False, True):
        runner, slots, first = prefilled(dense_ckpt, *load, prompts=PROMPTS[:1])
        graphs = DecodeGraphRunner(runner, [1, 2, 4, 8])
        (q, m), n = slots[0], len(PROMPTS[0])
        tokens = [first[0], 10, 11, 12]
        if verify:
            steps = [int(s) for s in runner.mamba_pool.alloc(len(tokens) - 1)]
            item = ExtendInput(q, m, n, tokens, step_slots=steps)
            locs = [runner.alloc_kv(q, n, len(tokens))]
            batch = runner.build_prefill([item], locs, return_all_logits=True, verify=True)
            logits.append(graphs.verify(batch)[0])
        else:
            rows = []
            for j, t in enumerate(tokens):
                loc = runner.alloc_kv(q, n + j, 1)
                rows.append(graphs.forward([DecodeInput(q, m, n + j, t)], loc))
            logits.append(torch.cat(rows))
    assert logits[0].shape[0] == 4
    assert torch.equal(logits[1], logits[0])


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5"])
def test_mtp_plan_equals_the_eager_head(tmp_path, preset):
    """The MTP head's plan (`CpuDecodePlan.for_mtp`): an extend pass of several rows per
    request, then a decode pass, give the eager head's logits and outputs, and the same KV
    (a sparse-MoE head and Qwen3.5's dense one)."""
    cfg = {**preset_config(preset), "mtp_num_hidden_layers": 1}
    path = write_checkpoint(tmp_path / "mtp", cfg, seed=2)
    outs, kvs = [], []
    hidden, h2 = torch.randn(8, cfg["hidden_size"]), torch.randn(2, cfg["hidden_size"])
    for planned in (False, True):
        model = load_model(path, dtype="float32", mtp=True)
        runner = ModelRunner(model, RunnerConfig(max_running_requests=4))
        plan = CpuDecodePlan.for_mtp(model) if planned else None
        rows = [(runner.req_pool.alloc(1)[0], 3), (runner.req_pool.alloc(1)[0], 5)]
        items = [ExtendInput(q, 0, 0, list(range(7, 7 + n))) for q, n in rows]
        locs = [runner.alloc_kv(q, 0, n + 1) for q, n in rows]
        batch = runner.build_prefill(
            items, [loc[:n] for loc, (_, n) in zip(locs, rows, strict=True)]
        )
        step = [DecodeInput(q, 0, n, 3) for q, n in rows]
        dec = runner.build_decode(
            step, torch.cat([loc[n:] for loc, (_, n) in zip(locs, rows, strict=True)])
        )
        if planned:
            with torch.inference_mode():
                x1 = model.mtp.layer_input(batch.input_ids, hidden, model.model.embed_tokens)
                x2 = model.mtp.layer_input(dec.input_ids, h2, model.model.embed_tokens)
            outs.append((*plan.verify(batch, x1), *plan.verify(dec, x2)))
        else:
            y1, y2 = model.mtp_hidden(batch, hidden), model.mtp_hidden(dec, h2)
            outs.append((model.draft_logits(y1), y1, model.draft_logits(y2), y2))
        kvs.append(runner.kv_pool.k_all[-1].clone())
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kvs[1], kvs[0], rtol=1e-4, atol=1e-5)
    assert kvs[0].abs().sum() > 0  # the head wrote its own KV layer
