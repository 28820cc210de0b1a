"""``count_flops``: the FLOPs of one forward and backward pass, counted without computing.

The model's parameters and the batch are replaced by fake tensors (shapes and
dtypes only, no storage), the model runs once through
``torch.func.functional_call`` and its loss is differentiated with respect to
the parameters, all under torch's ``FlopCounterMode``. Nothing is computed and the
model is left unchanged: a 7B-parameter model is counted on a laptop.

torch's counter counts matrix products, convolutions and attention (the
operations that dominate a step), each ``(m x k) @ (k x n)`` as ``2 * m * n * k``;
element-wise work (activations, norms, the optimizer) is not counted. For an
``nn.Linear`` the backward pass is two more products of the same size (the
weight's gradient and the input's), so a layer whose input needs a gradient costs
3x its forward, and the first layer (its input is data) 2x. Attention through
``scaled_dot_product_attention`` counts its two products forward and five
backward (the scores are recomputed), causal or not, as torch counts its GPU
kernels; the CPU kernel, which torch's table leaves out, is counted the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from funcaccel._checks import check_bool
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._tree import flatten
from funcaccel._tree import tree_map

__all__ = ["count_flops", "output_loss"]

_CALLER = "count_flops"


def output_loss(output: object) -> torch.Tensor:
    """The model's own ``loss`` when it returns one, else the sum of its outputs."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    _, leaves = flatten(output)
    floats = [
        leaf.float().sum()
        for leaf in leaves
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]
    if not floats:
        fail_value(
            _CALLER,
            "the model's output",
            output,
            "a floating-point tensor or a structure holding one",
            "Pass loss_fn=... to turn the output into a scalar loss.",
        )
    return torch.stack(floats).sum()


def _attention(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    """The CPU attention kernel's FLOPs, by torch's formula for its GPU kernels."""
    from torch.utils import flop_counter

    del args, kwargs  # dropout, causal flag, scale, the output's shape
    formula: Callable[..., int] = flop_counter.sdpa_flop_count  # untyped in torch
    return int(formula(q, k, v))


def _attention_backward(
    grad: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any
) -> int:
    """The CPU attention backward's FLOPs, by torch's formula for its GPU kernels."""
    from torch.utils import flop_counter

    del args, kwargs  # the output, log-sum-exp, dropout, causal flag, scale
    formula: Callable[..., int] = flop_counter.sdpa_backward_flop_count  # untyped
    return int(formula(grad, q, k, v))


def _cpu_attention() -> dict[Any, Any]:
    """Formulas for the CPU attention kernel, which torch's table leaves out."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: _attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
    }


def _call(model: nn.Module, state: dict[str, Any], batch: object) -> object:
    """Call ``model`` on ``batch`` with ``state`` in place of its tensors."""
    from torch.func import functional_call

    if isinstance(batch, Mapping):
        return functional_call(model, state, (), dict(batch))
    if isinstance(batch, tuple | list):
        return functional_call(model, state, tuple(batch))
    return functional_call(model, state, (batch,))


def count_flops(
    model: nn.Module,
    example_batch: object,
    *,
    backward: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> int:
    """Count the FLOPs of ``model`` on ``example_batch``: forward, and backward by default.

    ``example_batch`` is what one call of the model takes: a tensor (``model(x)``),
    a tuple or list of positional arguments, or a mapping of keyword arguments
    (``model(**batch)``, as a transformers model takes ``input_ids``). Its tensors
    may be real or on ``meta``; they are replaced by fake tensors of the same shape,
    so neither they nor ``model`` (real or ``meta``, unwrapped) are used for
    computation or changed. The loss differentiated is ``loss_fn(output)``, by
    default the output's ``loss`` attribute when it has one, else the sum of its
    floating-point tensors; the loss's own arithmetic is not a matrix product and
    does not count.

    Args:
        model: the module, unwrapped (not DDP/FSDP); left unchanged.
        example_batch: one micro-batch, as the model is called with it.
        backward: count the backward pass too (the gradient of every parameter
            that requires one); ``False`` for the forward pass only.
        loss_fn: turns the model's output into the scalar that is differentiated.

    Returns:
        The FLOPs of one pass (per batch, on one process), an int.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``backward`` not a bool.
        ValueError: ``backward`` with no parameter requiring a gradient, or an
            output with no floating-point tensor and no ``loss_fn``.

    >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> x = torch.zeros(5, 8)
    >>> count_flops(net, x, backward=False) == 2 * 5 * 8 * 16 + 2 * 5 * 16 * 4
    True
    >>> count_flops(net, x) == 2 * (2 * 5 * 8 * 16) + 3 * (2 * 5 * 16 * 4)
    True
    """
    if not isinstance(model, nn.Module):
        fail_type(_CALLER, "model", model, "an nn.Module")
    check_bool(_CALLER, "backward", backward)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    state: dict[str, Any] = {name: mode.from_tensor(p) for name, p in params.items()}
    state |= {
        name: mode.from_tensor(b)
        for name, b in model.named_buffers(remove_duplicate=False)
    }
    batch = tree_map(
        lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x,
        example_batch,
    )
    wanted = [state[name] for name, p in params.items() if p.requires_grad]
    if backward and not wanted:
        fail_value(
            _CALLER,
            "backward",
            backward,
            "False for a model with no parameter that requires a gradient",
            "Pass backward=False, or unfreeze a parameter.",
        )
    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention())
    with mode, counter:
        output = _call(model, state, batch)
        if backward:
            loss = (loss_fn or output_loss)(output)
            torch.autograd.grad(loss, wanted, allow_unused=True)
    return int(counter.get_total_flops())
