"""What a NemotronH checkpoint is (`model_type: nemotron_h`: Nemotron-H, Nemotron-Nano-9B/12B-v2,
Nemotron-3-Nano, Nemotron-3-Super): its `config.json`, read into one frozen dataclass.

The stack is a string of blocks, `hybrid_override_pattern` (or transformers 5.x's
`layers_block_type` list), one mixer per block:

    M  Mamba2 ("linear_attention")       -  relu^2 MLP ("mlp")
    *  attention, no positions ("full_attention")   E  MoE with a shared expert ("moe")

Defaults are transformers' own (its `NemotronHConfig`, with NVIDIA's legacy key names such as
`mamba_n_groups` or `mamba_dt_limit`); the fields that size the model must be in the file.
`intermediate_size` may be a list: one width for every MLP block, or one per MLP block in order
(as vLLM, SGLang and TensorRT-LLM read it). `time_step_limit` is the file's (default (0, inf)),
as NVIDIA's own code, vLLM and SGLang apply it; transformers' torch path clamps dt at
`time_step_min` instead (HF PR #48989), which this server does not follow.

Nemotron 3 Super adds two fields. `moe_latent_size` runs the routed experts in a smaller
width (`kernels.relu2_moe`). `num_nextn_predict_layers` with `mtp_layers_block_type` (default
attention then MoE; legacy `mtp_hybrid_override_pattern`) describes the multi-token-prediction
head: that many steps of those blocks, `mtp.layers.*` in the release (transformers builds no
head and ignores those tensors; `models.nemotron_h_mtp`). `mtp_layer_types` lists the head's
blocks, every step's, and `mtp_num_hidden_layers` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hybrid_serve.models.mamba2_hybrid_config import Mamba2StackConfig
from hybrid_serve.models.mamba2_mixer import Mamba2Config

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
LAYER_TYPES = (MAMBA, ATTENTION, MLP, MOE)
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}


@dataclass(frozen=True, kw_only=True)
class NemotronHConfig(Mamba2StackConfig):
    """One block per `layer_types` entry (LAYER_TYPES); attention without positions."""

    LAYER_TYPES: ClassVar[tuple[str, ...]] = LAYER_TYPES
    # relu^2 MLP and MoE
    mlp_intermediate_sizes: tuple[int, ...]  # one per MLP block, in order
    mlp_bias: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    n_group: int  # expert groups of the router's group-limited top-k
    topk_group: int  # groups a token may pick experts from
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_latent_size: int | None = None  # the routed experts' width, where not hidden_size
    num_nextn_predict_layers: int = 0  # MTP steps
    mtp_layer_types: tuple[str, ...] = ()  # the MTP head's blocks (ATTENTION, MLP or MOE)
    model_type: str = "nemotron_h"
    weight_prefix: str = "backbone."  # where the checkpoint's stack lives (our names too)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.mlp_intermediate_sizes) != self.layer_types.count(MLP):
            raise ValueError(
                f"config.json: intermediate_size has {len(self.mlp_intermediate_sizes)} "
                f"entries for {self.layer_types.count(MLP)} MLP blocks"
            )
        if MOE in self.layer_types:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError("config.json: num_experts_per_tok must be in 1..n_routed_experts")
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError("config.json: n_group must divide the experts, topk_group <= it")
        if self.moe_latent_size is not None and self.moe_latent_size <= 0:
            raise ValueError("config.json: moe_latent_size must be positive")
        bad = [t for t in self.mtp_layer_types if t not in (ATTENTION, MLP, MOE)]
        if bad:
            raise ValueError(f"config.json: unsupported mtp_layers_block_type entry {bad[0]!r}")
        if MOE in self.mtp_layer_types and MOE not in self.layer_types:
            raise ValueError("config.json: MTP MoE blocks need the model's MoE fields")

    @property
    def expert_width(self) -> int:
        """The width the routed experts read and write: `moe_latent_size`, else hidden."""
        return self.moe_latent_size or self.hidden_size

    def mlp_width(self, layer_id: int) -> int:
        """The intermediate size of MLP block `layer_id`."""
        return self.mlp_intermediate_sizes[self.layer_types[:layer_id].count(MLP)]

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict | None = None
    ) -> NemotronHConfig:
        """`raw` (a config.json's dict) completed by transformers' `NemotronHConfig`, which
        supplies every absent field's default. The fields that size the model (those read with
        `need`: vocabulary, hidden size, the block pattern, attention and Mamba heads, the state
        size, MLP and expert widths and counts) must be in `raw`: transformers' defaults for them
        are a full-size release's, so a file without one would silently build another model. EOS
        ids: `generation_config`'s, else the config's."""
        widths = raw.get("intermediate_size")
        # transformers' class takes one int: a per-block list is read here, not by the class
        for_hf = {**raw, "intermediate_size": 0} if isinstance(widths, list) else raw
        d = cls.complete("nemotron_h", for_hf)

        def need(*keys: str) -> Any:
            for key in keys:
                if key in raw:
                    return d.get(key, raw[key])
            either = "".join(f" (or {key!r})" for key in keys[1:])
            raise ValueError(f"config.json: missing field {keys[0]!r}{either}")

        need("hybrid_override_pattern", "layers_block_type")
        types = tuple(d["layers_block_type"])
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if d[key] != want:
                raise ValueError(f"config.json: unsupported {key} {d[key]!r}")
        if d["attention_bias"]:
            raise ValueError("config.json: attention_bias is unsupported (NemotronH has none)")
        n_mlp = types.count(MLP)
        if MLP not in types:
            mlp_widths: tuple[int, ...] = ()
        elif isinstance(widths, list):
            mlp_widths = tuple(int(w) for w in (widths * n_mlp if len(widths) == 1 else widths))
        else:
            mlp_widths = (int(need("intermediate_size")),) * n_mlp
        limit = tuple(float(v) for v in d["time_step_limit"])
        mamba = Mamba2Config(
            hidden_size=int(need("hidden_size")),
            num_heads=int(need("mamba_num_heads")),
            head_dim=int(need("mamba_head_dim")),
            n_groups=int(d["n_groups"]),
            state_size=int(need("ssm_state_size")),
            conv_kernel=int(d["conv_kernel"]),
            chunk_size=int(d["chunk_size"]),
            time_step_limit=(limit[0], limit[1]),
            conv_bias=bool(d["use_conv_bias"]),
            proj_bias=bool(d["use_bias"]),
            norm_eps=float(d["layer_norm_epsilon"]),
        )
        moe = MOE in types
        steps = int(d["num_nextn_predict_layers"] or 0)
        mtp_types = tuple(d["mtp_layers_block_type"] or ()) * steps
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            layer_types=types,
            rms_norm_eps=float(d["layer_norm_epsilon"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=int(d["head_dim"]),
            mamba=mamba,
            mlp_intermediate_sizes=mlp_widths,
            mlp_bias=bool(d["mlp_bias"]),
            num_experts=int(need("n_routed_experts")) if moe else 0,
            num_experts_per_tok=int(need("num_experts_per_tok")) if moe else 0,
            moe_intermediate_size=int(need("moe_intermediate_size")) if moe else 0,
            shared_expert_intermediate_size=int(d["moe_shared_expert_intermediate_size"])
            if moe
            else 0,
            n_group=int(d["n_group"]),
            topk_group=int(d["topk_group"]),
            norm_topk_prob=bool(d["norm_topk_prob"]),
            routed_scaling_factor=float(d["routed_scaling_factor"]),
            moe_latent_size=int(d["moe_latent_size"]) if moe and d["moe_latent_size"] else None,
            num_nextn_predict_layers=steps,
            mtp_layer_types=mtp_types,
            mtp_num_hidden_layers=len(mtp_types),
            **cls.checkpoint_fields(d, generation_config),
        )
