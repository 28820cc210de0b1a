"""``MemoryEstimate`` and ``RankMemory``: what ``estimate_memory`` found, as frozen values.

Bytes are per rank. ``RankMemory`` holds one rank's steady state (its parameters,
gradients and optimizer state, counted tensor by tensor) and its peak during a
training step with the parts torch's memory tracker attributes it to.
``MemoryEstimate`` holds the ranks that differ (an uneven shard gives the last
rank less; each pipeline stage's ranks hold other layers), the margin the
caller asked for, and what is not counted.

>>> rank = RankMemory(rank=0, parameters=4 * 2**20, gradients=4 * 2**20,
...                   optimizer_state=8 * 2**20, peak=20 * 2**20,
...                   peak_parts=(("activations", 4 * 2**20),))
>>> est = MemoryEstimate(world_size=8, mesh=(1, 1, 8, 1), strategy="fsdp",
...                      ranks=(rank,), margin=0.25)
>>> est.peak / 2**20, est.peak_with_margin / 2**20, est.mesh
(20.0, 25.0, (1, 1, 8, 1))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Final

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value

__all__ = ["NOT_COUNTED", "MemoryEstimate", "RankMemory"]

NOT_COUNTED: Final = (
    "the CUDA context and the kernels' code (hundreds of MiB per GPU)",
    "the caching allocator's fragmentation and reserved-but-free blocks",
    "NCCL's own communication buffers and streams",
    "memory of other libraries (cuBLAS / cuDNN workspaces, compiled kernels)",
    "the data loader's worker processes and pinned host memory",
)
"""What the estimate leaves out: add ``margin`` for it, or measure it once."""

GiB: Final = 2**30
MiB: Final = 2**20
MESH_DIMS: Final = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """One rank's memory in a training step, in bytes.

    Args:
        rank: the global rank.
        stages: the pipeline stages the rank runs (``()`` without a pipeline).
        parameters, gradients, optimizer_state: what the rank holds between
            steps: its parameters (shards), their gradients and the optimizer's
            state, each tensor counted once by its local size.
        peak: the highest total the memory tracker saw during the step.
        peak_parts: ``(part, bytes)`` pairs at that peak: parameters (sharded
            and unsharded), gradients, optimizer state, communication buffers,
            activations, temporaries; they add up to ``peak``.
    """

    rank: int
    parameters: int
    gradients: int
    optimizer_state: int
    peak: int
    peak_parts: tuple[tuple[str, int], ...] = ()
    stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = "RankMemory"
        check_int(owner, "rank", self.rank, 0)
        stages = check_type(owner, "stages", self.stages, tuple)
        for stage in stages:
            check_int(owner, "every stage", stage, 0)
        for name in ("parameters", "gradients", "optimizer_state", "peak"):
            check_int(owner, name, getattr(self, name), 0)
        parts = check_type(owner, "peak_parts", self.peak_parts, tuple)
        object.__setattr__(
            self, "peak_parts", tuple((str(k), int(v)) for k, v in parts)
        )

    @property
    def model_state(self) -> int:
        """``parameters + gradients + optimizer_state``."""
        return self.parameters + self.gradients + self.optimizer_state


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Per-rank memory of one training step at a world size, and its limits.

    Args:
        world_size: the number of ranks planned for.
        mesh: ``(pp, dp_replicate, dp_shard, tp)``, as ``ParallelMesh.shape``;
            a 3-tuple ``(dp_replicate, dp_shard, tp)`` is read with ``pp=1``.
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"hsdp"``, ``"tp"``,
            ``"fsdp+tp"`` or ``"hsdp+tp"``; with pipeline stages ``"pp"`` or
            ``"pp+"`` and what each stage is (``"pp+fsdp"``, ``"pp+replicate"``).
        ranks: the ranks estimated: rank 0, the first rank of every other
            pipeline stage, and after each the last rank of its stage when
            its shards are uneven.
        margin: the fraction added to the peak for what is not counted.
        not_counted: what the estimate leaves out (``NOT_COUNTED``).
        device: the device kind the sizes are for: ``"cpu"`` (each tensor's
            bytes) or ``"cuda"`` (each rounded up to 512 bytes).
    """

    world_size: int
    mesh: tuple[int, ...]
    strategy: str
    ranks: tuple[RankMemory, ...]
    margin: float = 0.1
    not_counted: tuple[str, ...] = NOT_COUNTED
    device: str = "cpu"

    def __post_init__(self) -> None:
        owner = "MemoryEstimate"
        check_int(owner, "world_size", self.world_size, 1)
        mesh = check_type(owner, "mesh", self.mesh, tuple)
        if len(mesh) == 3:  # written before pipeline stages were estimated
            mesh = (1, *mesh)
            object.__setattr__(self, "mesh", mesh)
        if len(mesh) != 4 or not all(isinstance(n, int) and n >= 1 for n in mesh):
            fail_value(
                owner, "mesh", mesh, "(pp, dp_replicate, dp_shard, tp), each >= 1"
            )
        check_type(owner, "ranks", self.ranks, tuple)
        if not self.ranks:
            fail_value(owner, "ranks", self.ranks, "at least one RankMemory")
        for rank in self.ranks:
            check_type(owner, "every rank", rank, RankMemory)
        check_type(owner, "margin", self.margin, (int, float))
        if not (math.isfinite(self.margin) and self.margin >= 0):
            fail_value(owner, "margin", self.margin, "a finite number >= 0")
        if self.device not in ("cpu", "cuda"):
            fail_value(owner, "device", self.device, "'cpu' or 'cuda'")

    @property
    def peak(self) -> int:
        """The highest rank's peak, in bytes (no margin)."""
        return max(rank.peak for rank in self.ranks)

    @property
    def peak_with_margin(self) -> int:
        """``peak * (1 + margin)``, rounded up: the figure to compare with a device."""
        return math.ceil(self.peak * (1 + self.margin))

    def fits(self, device_bytes: int) -> bool:
        """Whether ``peak_with_margin`` is at most ``device_bytes``."""
        return self.peak_with_margin <= check_int(
            "fits", "device_bytes", device_bytes, 1
        )

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready builtins (bytes as ints)."""
        return {
            "world_size": self.world_size,
            "mesh": dict(zip(MESH_DIMS, self.mesh, strict=True)),
            "strategy": self.strategy,
            "device": self.device,
            "margin": self.margin,
            "peak_bytes": self.peak,
            "peak_with_margin_bytes": self.peak_with_margin,
            "ranks": [
                {
                    "rank": r.rank,
                    "stages": list(r.stages),
                    "parameters": r.parameters,
                    "gradients": r.gradients,
                    "optimizer_state": r.optimizer_state,
                    "peak": r.peak,
                    "peak_parts": dict(r.peak_parts),
                }
                for r in self.ranks
            ],
            "not_counted": list(self.not_counted),
        }

    def table(self) -> str:
        """A Markdown table (GiB, or MiB below 1 GiB), a column per rank, then the limits."""
        heads = [_column(r) for r in self.ranks]
        unit, size = ("GiB", GiB) if self.peak >= GiB else ("MiB", MiB)
        rows: list[tuple[str, list[int]]] = [
            ("parameters (held)", [r.parameters for r in self.ranks]),
            ("gradients (held)", [r.gradients for r in self.ranks]),
            ("optimizer state (held)", [r.optimizer_state for r in self.ranks]),
        ]
        parts = dict.fromkeys(k for r in self.ranks for k, _ in r.peak_parts)
        for part in parts:
            rows.append(
                (
                    f"at peak: {part}",
                    [dict(r.peak_parts).get(part, 0) for r in self.ranks],
                )
            )
        rows.append(("**peak**", [r.peak for r in self.ranks]))
        margin = [math.ceil(r.peak * (1 + self.margin)) for r in self.ranks]
        rows.append((f"**peak + {100 * self.margin:g} % margin**", margin))
        shape = " x ".join(str(n) for n in self.mesh)
        lines = [
            f"{self.strategy} on {self.world_size} ranks "
            f"({' x '.join(MESH_DIMS)} = {shape}), {unit} per rank, "
            f"{self.device} sizes",
            "",
            "| | " + " | ".join(heads) + " |",
            "|---|" + "---:|" * len(heads),
        ]
        lines += [
            f"| {name} | " + " | ".join(f"{b / size:.3f}" for b in values) + " |"
            for name, values in rows
        ]
        lines += ["", "Not counted: " + "; ".join(self.not_counted) + "."]
        return "\n".join(lines)


def _column(rank: RankMemory) -> str:
    """``"rank 0"``, or with pipeline stages ``"rank 2 (stage 1)"`` / ``"(stages 1, 3)"``."""
    if not rank.stages:
        return f"rank {rank.rank}"
    word = "stage" if len(rank.stages) == 1 else "stages"
    return f"rank {rank.rank} ({word} {', '.join(map(str, rank.stages))})"
