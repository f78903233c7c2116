"""The weight formats a matrix may be stored in: one table, read by everything that needs to know.

A matrix [..., N, K] is ONE tensor whatever its format, so every op that takes a weight takes
any format in its place; the tensor's dtype names the format (`format_of`), and nothing else
infers it. Each entry says how a row of K values is stored (`in_features` reads K back from it),
where its scales live, whether `--quantization` makes it from float weights, whether the C++
kernels read it (kernels/csrc/weights.h holds the same layout: tests/kernels/test_quant.py
checks the two agree) and which devices serve it.

- float32, bfloat16: plain values, in row order. bf16 has a second order of the same bytes, K-pair
  panels (`hybrid_serve.kernels.bf16_pack`: panels of 64 rows, a panel's pair p the 64 rows'
  (k, k + 1) pairs, the short last panel the N % 64 rows left), which the panel product
  `hybrid_serve::bf16_panel_linear` reads. One rule says which: under the bf16 route
  (`KernelSet.bf16_products`) every bf16 matrix on the CPU is panels (the loader packs them:
  `models.loader.pack_matrices`); elsewhere bf16 is row order.
  Readers that take rows go through `bf16_pack.plain_rows` (`Linear.rows`).
- int8 (torch.int8): a row of K values then its fp32 scale's 4 bytes, the rows interleaved in
  tiles of 8 for the products (`hybrid_serve.kernels.quant`).
- int4 (torch.uint8): K/2 bytes of nibbles in groups of 32, then K/32 bf16 scales per row,
  the rows interleaved in tiles of 8 for the products (`hybrid_serve.kernels.quant`).
- fp8 (torch.float8_e4m3fn): e4m3 values with 128 x 128 block scales held beside them, not in
  the row (`kernels.fp8`: resident on CUDA; the CPU dequantizes block-FP8 checkpoints at load).

A format to come (AWQ/GPTQ int4 packed in int32 words with zero points, say) is one more entry
with its own storage dtype and layout, one more `widen` in kernels/quant.py, and its kernels.

The table names dtypes by torch's attribute names and imports no torch, so the API process can
validate flags with it (tests/server/test_imports.py); `kernels.quant` holds the torch side.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_BYTES = 4  # the fp32 scale at the end of every int8 row
GROUP = 32  # int4 values per bf16 scale


@dataclass(frozen=True)
class WeightFormat:
    name: str
    dtype: str  # the stored tensor's dtype (torch's name for it): the format is read from it
    row_tail: int  # bytes of scales at the end of every row (per GROUP values where grouped)
    group: int  # values per scale along K (0: one scale per row, or none, or block scales)
    method: bool  # made from float weights by `--quantization <name>`
    cpp: bool  # the C++ kernels read it (weights.h)
    devices: tuple[str, ...]  # where a model may keep matrices in this format

    def in_features(self, stored: int) -> int:
        """K of a row stored in `stored` columns."""
        if self.name == "int4":
            return stored * GROUP // (GROUP // 2 + self.row_tail)
        return stored - self.row_tail


FORMATS: tuple[WeightFormat, ...] = (
    WeightFormat("float32", "float32", 0, 0, False, True, ("cpu", "cuda")),
    WeightFormat("bfloat16", "bfloat16", 0, 0, False, True, ("cpu", "cuda")),
    WeightFormat("int8", "int8", SCALE_BYTES, 0, True, True, ("cpu",)),
    WeightFormat("int4", "uint8", 2, GROUP, True, True, ("cpu",)),
    WeightFormat("fp8", "float8_e4m3fn", 0, 0, False, False, ("cuda",)),
)
BY_DTYPE = {f.dtype: f for f in FORMATS}
QUANTIZATION_METHODS = tuple(f.name for f in FORMATS if f.method)


def format_of(w) -> WeightFormat | None:
    """The format of a stored matrix (a torch tensor), by its dtype (None: a dtype no format
    has, e.g. fp16)."""
    return BY_DTYPE.get(str(w.dtype).removeprefix("torch."))


def get(name: str) -> WeightFormat:
    for f in FORMATS:
        if f.name == name:
            return f
    raise ValueError(f"unknown weight format {name!r}")


def check_quantization(method: str | None, device: str, flag: str = "--quantization") -> None:
    """The one rule for a `--quantization` method (the server's config and the loader both ask
    it): a method of the table, on a device that serves it."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"{flag} must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    kind = str(device).split(":")[0]
    if kind not in get(method).devices:
        raise ValueError(f"{flag} {method} runs on the {' or '.join(get(method).devices).upper()}"
                         f" only, not {kind}")  # fmt: skip
