"""wrap_model on models built on the meta device: each rank materialises its shards only.

Every check compares with the same model built whole on the CPU from the same
seed: the full parameters must be equal (``torch.equal``), each rank must hold
only its part, and one SGD step afterwards must match the whole model's step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel

from funcaccel.context import DistributedContext
from funcaccel.mesh import build_mesh
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

F64 = torch.float64


class _MLP(nn.Module):
    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8, dtype=F64)
        self.down = nn.Linear(8, 3, dtype=F64)
        self.register_buffer("scale", torch.full((3,), 2.0, dtype=F64))

    def reset_parameters(self) -> None:  # the root's own tensor: the buffer
        nn.init.constant_(self.scale, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(x))) * self.scale
        return out


def _normal_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.5)
        nn.init.uniform_(module.bias, -0.1, 0.1)
    elif isinstance(module, _MLP):
        nn.init.constant_(module.scale, 3.0)


def _whole(init: str) -> nn.Module:
    torch.manual_seed(0)
    net = _MLP()
    if init == "init_fn":
        # The meta model drew nothing when built: init_fn starts from the seed.
        torch.manual_seed(0)
        for module in net.modules():
            _normal_init(module)
    return net


def _on_meta() -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        return _MLP()


X = torch.linspace(-1, 1, 48, dtype=F64).reshape(12, 4)
Y = torch.linspace(1, -1, 36, dtype=F64).reshape(12, 3)


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    torch.autograd.backward(F.mse_loss(model(x), y))
    opt.step()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in unwrap_model(model).state_dict().items()
    }


def _local_rows(model: nn.Module) -> int:
    inner = unwrap_model(model)
    assert isinstance(inner, _MLP)
    weight = inner.up.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return int(local.shape[0])


def _meta_on_meshes(
    ctx: DistributedContext, shapes: list[tuple[Any, ...]]
) -> list[dict[str, Any]]:
    out = []
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for r, s, t, use_fsdp, init in shapes:
        mesh = None if r is None else build_mesh(ctx, dp_replicate=r, dp_shard=s, tp=t)
        net = _on_meta()
        # An optimizer built on the meta parameters is re-pointed, as on real ones.
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        model = wrap_model(
            ctx,
            net,
            fsdp=FSDPOptions() if use_fsdp else None,
            mesh=mesh,
            tp_plan=plan if t > 1 else None,
            optimizers=opt,
            init_fn=_normal_init if init == "init_fn" else None,
        )
        start = _full(model)
        dp_size = ctx.num_processes if mesh is None else mesh.dp_size
        dp_rank = ctx.process_index if mesh is None else mesh.dp_rank
        per = X.shape[0] // dp_size
        _step(
            model,
            opt,
            X[dp_rank * per : (dp_rank + 1) * per],
            Y[dp_rank * per : (dp_rank + 1) * per],
        )
        out.append(
            {
                "type": type(model).__name__,
                "rows": _local_rows(model),
                "start": start,
                "stepped": _full(model),
            }
        )
    return out


def _check(
    results: list[list[dict[str, Any]]],
    shapes: list[tuple[Any, ...]],
    rows: list[list[int]],
) -> None:
    for rank, per_rank in enumerate(results):
        for got, shape, want_rows in zip(per_rank, shapes, rows, strict=True):
            init = shape[-1]
            whole = _whole(init)
            want = {k: v.detach().clone() for k, v in whole.state_dict().items()}
            assert got["start"].keys() == want.keys()
            for key, value in want.items():
                assert torch.equal(got["start"][key], value), (shape, key)
            assert got["rows"] == want_rows[rank], shape
            _step(whole, torch.optim.SGD(whole.parameters(), lr=0.5), X, Y)
            for key, value in whole.state_dict().items():
                assert torch.allclose(got["stepped"][key], value, rtol=0, atol=1e-10), (
                    shape,
                    key,
                )


SHAPES_4 = [
    (2, 2, 1, True, "reset"),  # HSDP
    (1, 2, 2, True, "init_fn"),  # FSDP x TP
    (2, 1, 2, False, "reset"),  # DDP x TP
    (None, None, 1, False, "init_fn"),  # plain DDP: materialised whole
]


@pytest.mark.distributed
def test_meta_models_on_4_ranks_equal_the_model_built_whole() -> None:
    results = run_ranks(_meta_on_meshes, 4, SHAPES_4, start_method="forkserver")
    assert [r["type"] for r in results[0]] == [
        "FSDP_MLP",
        "FSDP_MLP",
        "FSDP_MLP",
        "DistributedDataParallel",
    ]
    _check(results, SHAPES_4, [[4, 4, 4, 4], [2, 2, 2, 2], [4, 4, 4, 4], [8, 8, 8, 8]])


SHAPES_3 = [(None, None, 1, True, "reset"), (1, 3, 1, True, "init_fn")]


@pytest.mark.distributed
def test_meta_models_on_3_ranks_with_uneven_shards() -> None:
    # 8 rows over 3 FSDP2 ranks: 3, 3 and 2 (without and with a mesh).
    results = run_ranks(_meta_on_meshes, 3, SHAPES_3, start_method="forkserver")
    _check(results, SHAPES_3, [[3, 3, 2], [3, 3, 2]])


def test_a_meta_model_on_one_process_equals_the_whole_one() -> None:
    for init in ("reset", "init_fn"):
        model = wrap_model(
            rank_ctx(1, 0),
            _on_meta(),
            init_fn=_normal_init if init == "init_fn" else None,
        )
        for key, value in _whole(init).state_dict().items():
            assert torch.equal(model.state_dict()[key], value), key


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)
        self.gain = nn.Parameter(torch.ones(2))


def _zeros(module: nn.Module) -> None:
    for param in module.parameters(recurse=False):
        nn.init.zeros_(param)


def test_wrap_model_refuses_a_meta_model_it_cannot_initialise() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(2, 2), _Bare())
    with pytest.raises(
        ValueError,
        match=r"^wrap_model: init_fn must be given: the model is on meta, and its module "
        r"'1' \(_Bare\) has no reset_parameters\(\); got None\. Pass init_fn=",
    ):
        wrap_model(rank_ctx(1, 0), net)
    assert net[0].weight.is_meta  # nothing changed
    with pytest.raises(
        TypeError,
        match=r"wrap_model: init_fn must be a function of one module or None; got 3",
    ):
        wrap_model(rank_ctx(1, 0), net, init_fn=3)  # type: ignore[arg-type]
    wrap_model(rank_ctx(1, 0), net, init_fn=_zeros)
    assert not any(p.is_meta for p in net.parameters())
    assert all(torch.equal(p, torch.zeros_like(p)) for p in net.parameters())
