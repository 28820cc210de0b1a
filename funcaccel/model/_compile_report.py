"""``compile_report``: what ``torch.compile`` did to a model, as a value.

Read after the first steps (blocks compile at their first call). The counts come
from the ``GraphLog`` each ``compile_blocks`` call leaves on its blocks: the
compile id of every graph compiled for them. Dynamo's own compilation records
(``torch._dynamo.utils.get_compilation_metrics()``, the latest 64 by default)
tell, for those ids, which were resumed after a graph break and why a frame was
recompiled. Dynamo keeps graph-break reasons for the whole process only
(``torch._dynamo.utils.counters["graph_break"]``), so ``break_reasons`` lists
those, from every compiled function of the process.

>>> from torch import nn
>>> compile_report(nn.Linear(2, 2))
CompileReport(blocks=(), graphs=0, graph_breaks=0, recompiles=0, compile_ids=(), recompile_reasons=(), break_reasons=())
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any
from typing import Final

from torch import nn

from funcaccel._checks import check_type
from funcaccel.model._compile_blocks import GRAPH_LOG_ATTRIBUTE
from funcaccel.model._compile_blocks import GraphLog
from funcaccel.model._fast_order import compiled_in_place

__all__ = ["CompileReport", "compile_report"]

_RESUME: Final = "torch_dynamo_resume_in_"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompileReport:
    """What was compiled for a model (see ``compile_report``).

    Attributes:
        blocks: the names of the modules compiled in place (``""``: the model).
        graphs: the graphs compiled for them so far, recompiles included; 0
            means nothing ran compiled (yet).
        graph_breaks: graphs that resume a block after a graph break.
        recompiles: graphs compiled again for a frame already compiled once
            (a new shape, a new ``requires_grad``, another grad mode ...).
        compile_ids: dynamo's ``"frame/compile"`` id of each graph, in order.
        recompile_reasons: dynamo's reason for each recompile it still records.
        break_reasons: the first line of each graph-break reason dynamo counted
            in this process (from any compiled code, not only this model's).
    """

    blocks: tuple[str, ...]
    graphs: int
    graph_breaks: int
    recompiles: int
    compile_ids: tuple[str, ...]
    recompile_reasons: tuple[str, ...]
    break_reasons: tuple[str, ...]


def _metrics() -> dict[str, Any]:
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    # A frame's dynamo record (with its code name) plus, under the same id,
    # records of its backward's compilation, which have none. Ids start again
    # at 0 after torch._dynamo.reset(): the latest record of an id wins.
    frames: dict[str, Any] = {}
    for record in utils.get_compilation_metrics():
        if record.co_name is not None:
            frames[str(record.compile_id)] = record
    return frames


def _break_reasons() -> tuple[str, ...]:
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return ()
    reasons = utils.counters.get("graph_break", {})
    return tuple(sorted({str(r).splitlines()[0] for r in reasons}))


def compile_report(model: nn.Module) -> CompileReport:
    """Return what ``torch.compile`` compiled for ``model`` so far; nothing is changed.

    ``model`` may be wrapped (DDP) or sharded (FSDP2): its modules are searched
    through. Blocks compiled in place by hand (``module.compile()`` without
    ``compile_blocks``) are listed in ``blocks`` but their graphs are not
    counted.

    With 4 identical blocks compiled by ``compile_blocks`` and one training
    step: ``graphs`` is 2 (block 0 traced with an input that does not require
    grad, then once more for blocks 1-3, whose inputs do: one recompile), and
    ``graph_breaks`` 0 with ``fullgraph=True``; further steps of the same
    shapes add nothing.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    caller, what = "compile_report", "a torch.nn.Module"
    model = check_type(caller, "model", model, nn.Module, what=what)
    logs: dict[int, GraphLog] = {}
    for module in model.modules():
        log = module.__dict__.get(GRAPH_LOG_ATTRIBUTE)
        if isinstance(log, GraphLog):
            logs.setdefault(id(log), log)
    ids = tuple(cid for log in logs.values() for cid in log.compile_ids)
    metrics = _metrics() if ids else {}
    breaks = 0
    recompiles = 0
    reasons: list[str] = []
    for cid in ids:
        record = metrics.get(cid)
        if record is not None and str(record.co_name).startswith(_RESUME):
            breaks += 1
        frame_compile = cid.split("/")[-1]
        if frame_compile.isdigit() and int(frame_compile) > 0:
            recompiles += 1
            if record is not None and record.recompile_reason:
                reasons.append(str(record.recompile_reason))
    return CompileReport(
        blocks=tuple(compiled_in_place(model)),
        graphs=len(ids),
        graph_breaks=breaks,
        recompiles=recompiles,
        compile_ids=ids,
        recompile_reasons=tuple(reasons),
        break_reasons=_break_reasons() if breaks else (),
    )
