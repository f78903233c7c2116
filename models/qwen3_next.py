"""Qwen3-Next (Qwen team, 2025): a hybrid of Gated DeltaNet and gated full attention layers.

    h = x + mixer(norm(x))          mixer = GatedDeltaNet or GatedAttention, by `layer_types`
    y = h + mlp(norm(h))            mlp   = sparse MoE with shared expert, or a dense SwiGLU

Module names equal the checkpoint's, so loading is a name table (`load_weights`). The model reads
one `ForwardBatch` and returns logits for the last new token of each request (or every token).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from models.attention import GatedAttention
from models.config import FULL, ModelConfig
from models.forward_batch import ForwardBatch
from models.gated_delta_net import GatedDeltaNet
from models.layers import MLP, Linear, RMSNorm, RotaryEmbedding, SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_full_attention = config.layer_types[layer_id] == FULL
        if self.is_full_attention:
            self.self_attn = GatedAttention(config, config.full_attention_layers.index(layer_id))
        else:
            self.linear_attn = GatedDeltaNet(config, config.linear_attention_layers.index(layer_id))
        if config.is_moe_layer(layer_id):
            self.mlp: nn.Module = SparseMoE(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.shared_expert_intermediate_size,
                config.norm_topk_prob,
            )
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_full_attention:
            h = self.self_attn(h, cos_sin, batch)
        else:
            h = self.linear_attn(h, batch)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, rotary_dim]
        for layer in self.layers:
            x = layer(x, cos_sin, batch)
        return x


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3NextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] (last new token per request), or [T, vocab] with return_all_logits."""
        x = self.model(batch)
        if not (batch.return_all_logits and not batch.is_decode):
            x = x if batch.is_decode else x[batch.last_token_indices()]
        return self.lm_head(self.model.norm(x)).float()

    # ---- checkpoint names ----------------------------------------------------------------
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the checkpoint names consumed.

        Accepts per-expert (`experts.{e}.gate_proj.weight`) and fused (`experts.gate_up_proj`)
        expert layouts and the grouped GDN projections. An unexpected name raises `KeyError`
        naming it; the caller checks for missing ones. `mtp.*` is skipped.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        num_experts = self.config.num_experts
        for name, w in tensors:
            if name.startswith("mtp."):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints still carry a copy
            target, rows = name, None
            if ".mlp.experts." in name and not name.endswith(("gate_up_proj", "down_proj")):
                prefix, rest = name.split(".mlp.experts.")
                expert, proj, _ = rest.split(".")  # "{e}.{gate|up|down}_proj.weight"
                e = int(expert)
                if not 0 <= e < num_experts:
                    raise KeyError(f"unexpected checkpoint tensor {name}")
                target = (
                    f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
                )
                inter = self.config.moe_intermediate_size
                rows = {"gate_proj": (e, 0), "up_proj": (e, inter), "down_proj": (e, None)}.get(
                    proj
                )
                if rows is None:
                    raise KeyError(f"unexpected checkpoint tensor {name}")
            elif name.endswith("linear_attn.in_proj_qkvz.weight"):
                w = GatedDeltaNet.regroup_qkvz(w, self.config)
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                w = GatedDeltaNet.regroup_ba(w, self.config)
            param = params.get(target)
            if param is None:
                raise KeyError(f"unexpected checkpoint tensor {name}")
            if rows is None:
                dst = param.data
            else:
                e, off = rows
                dst = param.data[e] if off is None else param.data[e, off : off + w.shape[0]]
            if dst.shape != w.shape:
                raise ValueError(
                    f"checkpoint tensor {name}: shape {tuple(w.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(w)
            filled.add(name)
        return filled

    def expected_checkpoint_names(self, expert_layout: str) -> set[str]:
        """Names a complete checkpoint provides for this model (the strict loader's contract)."""
        names = set()
        for pname, _ in self.named_parameters():
            if pname.endswith("mlp.experts.gate_up_proj") and expert_layout == "per_expert":
                base = pname.removesuffix("gate_up_proj")
                for e in range(self.config.num_experts):
                    names |= {f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight"}
            elif pname.endswith("mlp.experts.down_proj") and expert_layout == "per_expert":
                base = pname.removesuffix("down_proj")
                names |= {f"{base}{e}.down_proj.weight" for e in range(self.config.num_experts)}
            else:
                names.add(pname)
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names
