"""Every parameter's tensor-parallel shard is declared by the module holding it
(`models.tp_shards`): a model with an undeclared parameter is refused at TP > 1, naming it, and
`target_shard` cuts a checkpoint tensor from its parameter's declaration and weight-map target.
(`tests/models/test_checkpoint_layouts.py` checks every tensor of every layout shards to the
shape it fills; the tensor-parallel tests check the sharded model's outputs.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybrid_serve.make_model.catalog import family_presets, tiny_presets
from hybrid_serve.make_model.checkpoint_writer import complete_config
from hybrid_serve.models.families import FAMILIES, resolve
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.registry import model_class
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import param_shards, target_shard
from hybrid_serve.models.weight_map import Target


def tiny_model(family, tp: ParallelContext) -> nn.Module:
    """`family`'s first tiny preset built for `tp` on the meta device."""
    raw = complete_config(family_presets(family)[tiny_presets(family)[0]])
    config = resolve(family.config_class).from_dict(raw)
    with torch.device("meta"):
        return model_class(config)(config, tp=tp)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_parameter_is_declared(family):
    model = tiny_model(family, ParallelContext(1, 2))
    shards = param_shards(model, model.config)
    assert list(shards) == [name for name, _ in model.named_parameters()]
    assert any(s is None for s in shards.values()) and any(s for s in shards.values())


def test_an_undeclared_parameter_is_refused_at_tp2():
    family = FAMILIES[0]
    model = tiny_model(family, ParallelContext(0, 2))
    attention = next(m for m in model.modules() if hasattr(m, "q_proj"))
    attention.sink = nn.Parameter(torch.zeros(4, device="meta"))  # a module with declarations
    name = next(n for n, p in model.named_parameters() if p is attention.sink)
    with pytest.raises(ValueError, match=rf"parameter {name} is sharded"):
        model.checkpoint_shard(name, Target(name))
    plain = tiny_model(family, ParallelContext(0, 2))
    plain.extra = nn.Linear(2, 2, device="meta")  # a module without any
    with pytest.raises(ValueError, match=r"parameter extra\.weight is sharded \(2 undeclared"):
        param_shards(plain, plain.config)


def test_an_undeclared_parameter_is_read_whole_at_tp1():
    model = tiny_model(FAMILIES[0], ParallelContext())
    model.extra = nn.Linear(2, 2, device="meta")
    assert model.checkpoint_shard("extra.weight", Target("extra.weight")) is None


FUSED = Shard(0, ((2, 4), (10, 12), (20, 22)), segments=(8, 8, 8))  # 3 parts of 8, 2 rows each


@pytest.mark.parametrize(
    ("index", "want"),
    [
        ((), Shard(0, ((2, 4), (10, 12), (20, 22)))),  # the whole parameter
        ((slice(0, 2),), Shard(0, ((2, 4),))),  # the first part's tensor
        ((slice(2, 6),), Shard(0, ((2, 4), (12, 14)))),  # the last two parts' tensor
        ((slice(4, 6),), Shard(0, ((4, 6),))),
    ],
)
def test_target_shard_keeps_the_parts_a_tensor_fills(index, want):
    assert target_shard(FUSED, Target("p", index)) == want


def test_target_shard_drops_stacked_dimensions():
    gate_up = Shard(1, ((0, 3), (6, 9)), segments=(6, 6))  # [E, 2I, H], I = 6, 3 per rank
    assert target_shard(gate_up, Target("p", (5,))) == Shard(0, ((0, 3), (6, 9)))
    assert target_shard(gate_up, Target("p", (5, slice(3, 6)))) == Shard(0, ((0, 3),))
    down = Shard(2, ((3, 6),))  # [E, H, I]
    assert target_shard(down, Target("p", (5,))) == Shard(1, ((3, 6),))
    vocab = Shard(0, ((8, 15),), rows=7)
    assert target_shard(vocab, Target("p")) == vocab


def test_target_shard_refuses_a_slice_through_a_part():
    with pytest.raises(ValueError, match="cuts through"):
        target_shard(FUSED, Target("p", (slice(1, 4),)))
    with pytest.raises(ValueError, match="parts are undeclared"):
        target_shard(Shard(0, ((0, 2), (4, 6))), Target("p", (slice(0, 2),)))
