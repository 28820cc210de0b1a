"""compile_blocks / CompileOptions / compile_report in one process.

The blocks are tiny and compiled with a cheap backend ("aot_eager": dynamo and
AOTAutograd, no code generation) and ``fullgraph=True``, so a graph break inside
a block is an error; inductor runs once, in the exactness test. Dynamo's caches
are process-wide: each test that counts starts with ``torch._dynamo.reset()``.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any
from typing import Literal

import pytest
import torch
import torch._dynamo
from torch import nn

from funcaccel.accumulate import accumulate_step
from funcaccel.accumulate import sync_ctx
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.mixed_precision import autocast_ctx
from funcaccel.model import ActivationCheckpointOptions
from funcaccel.model import CompileOptions
from funcaccel.model import CompileReport
from funcaccel.model import DeepSpeedOptions
from funcaccel.model import apply_activation_checkpointing
from funcaccel.model import compile_blocks
from funcaccel.model import compile_report
from funcaccel.model import wrap_model
from funcaccel.sync import no_sync
from tests._fast_step_models import Block
from tests._fast_step_models import TinyNet
from tests._fast_step_models import batches
from tests._fast_step_models import loss_of

CHEAP = CompileOptions(blocks=[Block], backend="aot_eager")

# Dynamo reads .grad of the non-leaf tensors it traces (for its guards), which
# makes torch warn; the warning is about dynamo's own access, not the test's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
)


class Recorder:
    """A backend that records each graph's output dtypes and operator count."""

    def __init__(self) -> None:
        self.graphs: list[tuple[list[str], int]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        del example_inputs  # only the graph is inspected
        dtypes = sorted(
            {
                str(node.meta["example_value"].dtype)
                for node in gm.graph.nodes
                if isinstance(node.meta.get("example_value"), torch.Tensor)
            }
        )
        calls = sum(
            1 for n in gm.graph.nodes if n.op in ("call_function", "call_module")
        )
        self.graphs.append((dtypes, calls))
        return gm.forward


def _train(
    ctx: DistributedContext,
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    k: int,
    *,
    epochs: int = 1,
    max_grad_norm: float | None = None,
    after_first: list[CompileReport] | None = None,
) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(epochs):
        grad = GradState(accumulation_steps=k)
        for i, batch in enumerate(data):
            loss, grad = accumulate_step(
                ctx,
                grad,
                model,
                opt,
                functools.partial(loss_of, model, batch),
                end_of_dataloader=i == len(data) - 1,
                max_grad_norm=max_grad_norm,
            )
            losses.append(loss.item())
            if after_first is not None and not after_first:
                after_first.append(compile_report(model))
    return losses


def test_compile_options_are_checked_when_built() -> None:
    with pytest.raises(
        ValueError, match=r"mode must be one of 'default', .*got 'fast'"
    ):
        CompileOptions(mode="fast")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"mode must be None with a backend other than"
    ):
        CompileOptions(backend="eager", mode="max-autotune")
    with pytest.raises(TypeError, match=r"fullgraph must be a bool; got 1"):
        CompileOptions(fullgraph=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"backend must be a backend name or a backend"):
        CompileOptions(backend=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"every item of blocks must be an nn.Module"):
        CompileOptions(blocks=["Block"])  # type: ignore[list-item]
    assert CompileOptions().fullgraph is True  # a graph break is an error by default


def test_compile_blocks_refuses_wrong_orders() -> None:
    net = TinyNet(blocks=2)
    assert compile_blocks(net, CHEAP) == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match=r"'blocks.0' is already compiled in place"):
        compile_blocks(net, CHEAP)
    inner: nn.Module = torch.compile(Block(8), backend="eager")  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"'0' is a torch.compile wrapper .*in place"):
        compile_blocks(nn.Sequential(inner), CompileOptions(backend="eager"))
    with pytest.raises(ValueError, match=r"no module of model \(Linear\) is a Block"):
        compile_blocks(nn.Linear(2, 2), CHEAP)
    with pytest.raises(TypeError, match=r"compile_blocks: options must be a Compile"):
        compile_blocks(net, None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"wrap_model: compile must be a CompileOptions"
    ):
        wrap_model(DistributedContext(), TinyNet(), compile=CHEAP.blocks)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"wrap_model: compile must be None with deeps"
    ):
        wrap_model(
            DistributedContext(), TinyNet(), deepspeed=DeepSpeedOptions(), compile=CHEAP
        )


def test_accumulation_autocast_clipping_and_no_sync_add_no_graph_break() -> None:
    """fullgraph=True: any break inside a block would raise; the report counts 0."""
    torch._dynamo.reset()
    ctx = DistributedContext(mixed_precision="bf16")
    torch.manual_seed(0)
    model = wrap_model(ctx, TinyNet(), compile=CHEAP)
    data = batches(7, 4, dtype=torch.float32)
    first: list[CompileReport] = []
    _train(ctx, model, data, 3, epochs=2, max_grad_norm=0.5, after_first=first)
    grad = GradState(accumulation_steps=2)
    with sync_ctx(ctx, grad, model), no_sync(ctx, model), autocast_ctx(ctx):
        torch.autograd.backward(loss_of(model, data[0]))
    report = compile_report(model)
    assert report.blocks == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert report.graph_breaks == 0 and report.break_reasons == ()
    # Block 0 (input without grad) and blocks 1-3 (with): two graphs, then none:
    # two epochs of windows of 3, each ending in a short window of 1, recompile nothing.
    assert (first[0].graphs, first[0].recompiles) == (2, 1)
    assert report.graphs == 2 and report.recompiles == 1
    assert "requires_grad mismatch" in report.recompile_reasons[0]


def test_a_new_batch_shape_is_one_counted_recompile() -> None:
    torch._dynamo.reset()
    ctx = DistributedContext()
    model = wrap_model(ctx, TinyNet(), compile=CHEAP)
    data = batches(4, 4, dtype=torch.float32) + batches(1, 3, dtype=torch.float32)
    _train(ctx, model, data, 2, epochs=2)
    report = compile_report(model)
    # The 3-row tail batch recompiles once per graph, dynamic in the batch size
    # (torch's automatic dynamic shapes); the second epoch adds nothing. (Dynamo
    # gives as reason the first guard that failed, here requires_grad.)
    assert (report.graphs, report.recompiles, report.graph_breaks) == (4, 3, 0)


def test_autocast_reaches_the_compiled_block() -> None:
    torch._dynamo.reset()
    ctx = DistributedContext(mixed_precision="bf16")
    recorder = Recorder()
    torch.manual_seed(0)
    model = TinyNet(blocks=1)
    eager = copy.deepcopy(model)
    compile_blocks(model, CompileOptions(blocks=[Block], backend=recorder))
    x = batches(1, 4, dtype=torch.float32)[0][0]
    with autocast_ctx(ctx):
        out = model.blocks(x)
        want = eager.blocks(x)
    assert torch.equal(out, want)
    # The graph itself computes in bfloat16 (the residual adds the float32
    # input back): autocast was traced, not bypassed.
    ((dtypes, calls),) = recorder.graphs
    assert dtypes == ["torch.bfloat16", "torch.float32"] and calls >= 5
    assert compile_report(model).graphs == 1


def test_a_hook_on_the_root_does_not_make_compilation_a_no_op() -> None:
    torch._dynamo.reset()
    recorder = Recorder()
    torch.manual_seed(0)
    model = TinyNet(blocks=2)
    eager = copy.deepcopy(model)
    for net in (model, eager):
        net.register_forward_pre_hook(lambda _m, args: (args[0] * 2,))
        net.register_forward_hook(lambda _m, _args, out: out + 1)
    assert compile_blocks(model, CompileOptions(backend=recorder)) == [""]
    x = batches(1, 4, dtype=torch.float32)[0][0]
    out = model(x)
    assert torch.allclose(out, eager(x), rtol=1e-6, atol=1e-6)
    report = compile_report(model)
    assert report.blocks == ("",) and report.graphs >= 1
    # Each hook is a frame of its own (one operation each); the forward, with
    # 2 blocks of 5 operations and the head, is compiled whole in between.
    assert [calls for _, calls in recorder.graphs] == [1, 13, 1]


class Breaking(Block):
    """A block with a graph break in the middle."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(self.norm(x)))
        torch._dynamo.graph_break()
        out: torch.Tensor = self.down(h)
        return x + out


def test_graph_breaks_are_reported_or_refused_by_fullgraph() -> None:
    torch._dynamo.reset()
    net = nn.Sequential(Breaking(8))
    compile_blocks(net, CompileOptions(blocks=[Breaking], backend="eager"))
    with pytest.raises(Exception, match=r"graph_break"):
        net(torch.randn(2, 8))
    torch._dynamo.reset()
    net = nn.Sequential(Breaking(8))
    options = CompileOptions(blocks=[Breaking], backend="eager", fullgraph=False)
    compile_blocks(net, options)
    net(torch.randn(2, 8))
    report = compile_report(net)
    assert report.graph_breaks == 1 and report.graphs == 2
    assert any("graph_break()" in reason for reason in report.break_reasons)


@pytest.mark.filterwarnings(
    # inductor's C++ code cache still calls a deprecated torch.jit decorator
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)
def test_compiled_training_equals_eager_in_one_process_with_inductor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor once: losses and parameters within float32 round-off of eager."""
    # Inductor records a setting of its own in os.environ on first use; undone
    # after the test (funcaccel itself writes nothing there).
    # (setenv first, so that monkeypatch restores the variable's absence.)
    name = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"
    monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.delenv(name)
    torch._dynamo.reset()
    ctx = DistributedContext()
    data = batches(5, 4, dtype=torch.float32)  # windows of 2: 2, 2, then a short 1
    torch.manual_seed(0)
    eager = TinyNet()
    compiled = wrap_model(
        ctx, copy.deepcopy(eager), compile=CompileOptions(blocks=[Block])
    )
    want = _train(ctx, eager, data, 2, epochs=2)
    got = _train(ctx, compiled, data, 2, epochs=2)
    assert compile_report(compiled).graphs == 2
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-6
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_and_compiled_blocks_give_eager_gradients(
    mode: Literal["full", "selective"],
) -> None:
    """Checkpointing inside the compiled graph (float64, aot_eager) changes nothing."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = TinyNet().to(torch.float64)
    fast = wrap_model(
        DistributedContext(),
        copy.deepcopy(eager),
        compile=CHEAP,
        activation_checkpointing=ActivationCheckpointOptions(
            blocks=[Block], mode=mode, every_n=1 if mode == "full" else 2
        ),
    )
    batch = batches(1, 4)[0]
    torch.autograd.backward(loss_of(eager, batch))
    torch.autograd.backward(loss_of(fast, batch))
    for p, q in zip(fast.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    report = compile_report(fast)
    # Every 2nd block checkpointed: the plain and the checkpointed blocks run
    # different code, one graph more.
    assert report.graphs == (2 if mode == "full" else 3)
    assert report.graph_breaks == 0


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 2), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out


def test_compile_blocks_refuses_a_block_running_torchs_own_forward() -> None:
    # torch.compile skips a frame of torch.nn's own forward when a module is
    # compiled in place: an nn.Sequential block would run uncompiled.
    net = _Outer()
    with pytest.raises(
        ValueError,
        match=r"compile_blocks: block 'inner' \(Sequential\) runs torch's own forward",
    ):
        compile_blocks(net, CompileOptions(blocks=(nn.Sequential,), backend="eager"))
    with pytest.raises(ValueError, match=r"block the model itself \(Sequential\)"):
        compile_blocks(net.inner, CompileOptions(backend="eager"))
    assert compile_blocks(net, CompileOptions(backend="eager")) == [""]  # _Outer's
    # Checkpointed first, the block's forward is funcaccel's, and it compiles.
    torch._dynamo.reset()
    inner = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    apply_activation_checkpointing(inner, ActivationCheckpointOptions())
    assert compile_blocks(inner, CompileOptions(backend="eager")) == [""]
    inner(torch.ones(3, 2, requires_grad=True)).sum().backward()
    assert compile_report(inner).graphs >= 1
