"""``estimate_from_path``: ``estimate_memory`` for a model named by an import path.

What ``python -m funcaccel estimate`` runs. ``MODULE:NAME`` names a function
(or class) called without arguments: the object it returns is the model (an
``nn.Module``) or a transformers config, from which
``AutoModelForCausalLM.from_config`` builds a causal language model. A
transformers model gets a batch of token ids (``batch_size x seq_len``, labels
included); any other model a float tensor of ``input_shape``. With ``tp > 1``
the tensor-parallel plan is ``tp_plan`` (an import path of a mapping from
module names to torch parallel styles) or, for a transformers model, its
config's ``base_model_tp_plan`` ("colwise" / "rowwise" entries). With
``pp > 1`` the model (a chain of units, not a transformers model) is cut into
pipeline stages: ``input_shape`` is one micro-batch's, and a pipeline step's
batch is ``microbatches`` of them (targets: one zero per row, which the default
loss, the sum of the output, does not read).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel._checks import fail_value
from funcaccel.model import FSDPOptions
from funcaccel.model import PipelineOptions
from funcaccel.planning._estimate import MemoryEstimate
from funcaccel.planning._memory import estimate_memory

__all__ = ["estimate_from_path", "import_object"]

_CALLER: Final = "python -m funcaccel estimate"
_OPTIMIZERS: Final = MappingProxyType(
    {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }
)


def import_object(path: str) -> Any:
    """Return the object ``MODULE:NAME`` (``NAME`` may be dotted) names.

    >>> import_object("collections:OrderedDict").__name__
    'OrderedDict'
    """
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        fail_value(
            _CALLER,
            "the model",
            path,
            "an import path MODULE:NAME",
            "E.g. mypkg.models:build_model or transformers:LlamaConfig.",
        )
    value: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


def _is_config(value: object) -> bool:
    return hasattr(value, "model_type") and hasattr(value, "to_dict")


def _model_factory(path: str) -> tuple[Callable[[], nn.Module], Any]:
    """The function that builds the model, and its transformers config (or None)."""
    made = import_object(path)()
    if isinstance(made, nn.Module):
        # Built once here to check it; estimate_memory builds it again on meta.
        factory = import_object(path)
        return factory, getattr(made, "config", None)
    if _is_config(made):
        from transformers import AutoModelForCausalLM

        config = made
        build: Callable[..., nn.Module] = AutoModelForCausalLM.from_config  # untyped
        return lambda: build(config), config
    fail_value(
        _CALLER,
        "the model",
        path,
        "the path of a function returning an nn.Module or a transformers config",
    )


def _hf_plan(config: Any) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {}
    for name, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        if style not in styles:
            fail_value(
                _CALLER,
                f"the config's tp plan entry {name!r}",
                style,
                "'colwise' or 'rowwise'",
                "Pass --tp-plan MODULE:NAME with torch parallel styles.",
            )
        plan[f"model.{name}"] = styles[style]()
    if not plan:
        fail_value(
            _CALLER,
            "--tp-plan",
            None,
            "given with --tp > 1 (the config has no base_model_tp_plan)",
            "Pass --tp-plan MODULE:NAME, a mapping of module names to styles.",
        )
    return plan


def _shard_classes(factory: Callable[[], nn.Module], config: Any) -> tuple[type, ...]:
    """The block classes a transformers model names in ``_no_split_modules``."""
    if config is None:
        return ()
    with torch.device("meta"):
        model = factory()
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def estimate_from_path(
    path: str,
    *,
    world_size: int,
    pp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    tp: int = 1,
    fsdp: bool = False,
    tp_plan: str | None = None,
    batch_size: int = 1,
    seq_len: int = 2048,
    input_shape: Sequence[int] | None = None,
    accumulation_steps: int = 1,
    optimizer: str = "adamw",
    mixed_precision: str = "no",
    margin: float = 0.1,
    device: str | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
) -> MemoryEstimate:
    """Estimate the model ``path`` names (see the module's docstring).

    ``microbatches`` (``None``: ``pp * stages_per_rank``, the fewest torch's
    schedules take), ``schedule`` and ``stages_per_rank`` make the
    ``PipelineOptions`` when ``pp > 1``.

    Raises:
        ValueError: a path that names nothing usable, a missing input shape or
            tensor-parallel plan, ``pp > 1`` for a transformers model; and what
            ``PipelineOptions`` or ``estimate_memory`` raise.
    """
    factory, config = _model_factory(path)
    pipeline = None
    if pp > 1:
        if config is not None:
            fail_value(
                _CALLER,
                "--pp",
                pp,
                "1 for a transformers model (its forward is not a chain of units "
                "that pipeline stages can cut)",
                "Pass a function returning a chain (an nn.Sequential) with "
                "--input-shape.",
            )
        count = pp * stages_per_rank if microbatches is None else microbatches
        pipeline = PipelineOptions(
            microbatches=count, schedule=schedule, stages_per_rank=stages_per_rank
        )
    if config is not None:
        ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
        batch: object = {"input_ids": ids, "labels": ids}
    elif input_shape is not None:
        shape = tuple(input_shape)
        batch = torch.zeros(shape)
        if pipeline is not None and shape:  # a step: every micro-batch, targets
            rows = pipeline.microbatches * shape[0]
            batch = (torch.zeros((rows, *shape[1:])), torch.zeros(rows))
    else:
        fail_value(
            _CALLER,
            "--input-shape",
            None,
            "given for a model that is not a transformers model",
            "Pass e.g. --input-shape 32,1024 (one micro-batch of one rank).",
        )
    plan = None
    if tp > 1:
        plan = import_object(tp_plan) if tp_plan is not None else _hf_plan(config)
    options = (
        FSDPOptions(shard_modules=_shard_classes(factory, config)) if fsdp else None
    )
    if optimizer not in _OPTIMIZERS:
        fail_value(_CALLER, "--optimizer", optimizer, f"one of {sorted(_OPTIMIZERS)}")
    return estimate_memory(
        factory,
        batch,
        world_size=world_size,
        optimizer_fn=_OPTIMIZERS[optimizer],
        pp=pp,
        pipeline=pipeline,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        tp=tp,
        tp_plan=plan,
        fsdp=options,
        accumulation_steps=accumulation_steps,
        mixed_precision=mixed_precision,  # type: ignore[arg-type]
        margin=margin,
        device=device,
    )
