"""``Throughput``: tokens/s, samples/s, TFLOP/s per device and MFU of a window, as a value.

A window is a stretch of training (an optimizer step, a logging interval, an
epoch) that took ``seconds`` of wall time. ``Throughput`` holds what the whole
world did in it: the tokens (the ones the loss counts: padding excluded) and
samples summed over every rank and micro-batch, and the FLOPs, also summed. The
rates follow by division; ``measure_throughput`` builds one from this rank's
counts with one small all-reduce.

>>> t = Throughput(seconds=2.0, tokens=8_000, flops=4e15, num_devices=4,
...                peak_flops_per_device=1e15)
>>> t.tokens_per_second, t.tflops_per_device, t.mfu
(4000.0, 500.0, 0.5)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

import torch

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import is_real
from funcaccel._ctx_checks import check_context
from funcaccel.collectives import gather
from funcaccel.context import DistributedContext

__all__ = ["PEAK_FLOPS", "Throughput", "measure_throughput", "peak_flops"]

PEAK_FLOPS: Final = (
    # (name as the device reports it, dense bf16 tensor-core FLOP/s from the
    # vendor's datasheet; fp16 for the V100, which has no bf16). Matched in this
    # order, so the more specific names come first.
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)
"""Peak dense bf16 FLOP/s of common accelerators, by a name their device name contains."""


def peak_flops(device_name: str) -> float:
    """Return the peak dense bf16 FLOP/s of the accelerator ``device_name`` names.

    ``device_name`` is matched case-insensitively against the names of
    ``PEAK_FLOPS``, the first contained name winning, so the string
    ``torch.cuda.get_device_name()`` returns works as it is.

    >>> peak_flops("NVIDIA H100 80GB HBM3") / 1e12
    989.0
    >>> peak_flops("NVIDIA H100 PCIe") / 1e12
    756.0

    Raises:
        TypeError: ``device_name`` is not a str.
        ValueError: no name of the table is in it; the table's names are listed.
    """
    check_type("peak_flops", "device_name", device_name, str)
    lowered = device_name.lower()
    for name, flops in PEAK_FLOPS:
        if name.lower() in lowered:
            return flops
    names = ", ".join(name for name, _ in PEAK_FLOPS)
    fail_value(
        "peak_flops",
        "device_name",
        device_name,
        f"a name containing one of {names}",
        "Pass the peak as a number instead (peak_flops_per_device=...).",
    )


def _check_count(owner: str, name: str, value: object) -> None:
    if value is None:
        return
    if not is_real(value):
        check_type(owner, name, value, (int, float), optional=True)
    assert isinstance(value, int | float)
    if not (math.isfinite(value) and value >= 0):
        fail_value(owner, name, value, "a finite number >= 0, or None")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """What the world did in one window of training, and the rates that follow.

    Args:
        seconds: the window's wall time (> 0).
        tokens: tokens processed by every rank in the window, padding excluded
            (the tokens the loss counts); ``None`` when not counted.
        samples: samples processed by every rank in the window, or ``None``.
        flops: FLOPs performed by every rank in the window (``count_flops`` of a
            micro-batch times the micro-batches of all ranks), or ``None``.
        num_devices: the devices that shared the work (>= 1).
        peak_flops_per_device: one device's peak FLOP/s, a number or a device
            name ``peak_flops`` knows (``"H100"``); ``None`` leaves MFU out.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range.
    """

    seconds: float
    tokens: int | None = None
    samples: int | None = None
    flops: float | None = None
    num_devices: int = 1
    peak_flops_per_device: float | str | None = None

    def __post_init__(self) -> None:
        owner = "Throughput"
        check_type(owner, "seconds", self.seconds, (int, float))
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            fail_value(owner, "seconds", self.seconds, "a finite number > 0")
        for name in ("tokens", "samples"):
            value = getattr(self, name)
            if value is not None:
                check_int(owner, name, value, 0)
        _check_count(owner, "flops", self.flops)
        check_int(owner, "num_devices", self.num_devices, 1)
        peak = self.peak_flops_per_device
        if isinstance(peak, str):
            object.__setattr__(self, "peak_flops_per_device", peak_flops(peak))
        elif peak is not None:
            _check_count(owner, "peak_flops_per_device", peak)
            if peak == 0:
                fail_value(owner, "peak_flops_per_device", peak, "> 0, or None")

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens per second over the whole world, or ``None`` without ``tokens``."""
        return None if self.tokens is None else self.tokens / self.seconds

    @property
    def samples_per_second(self) -> float | None:
        """Samples per second over the whole world, or ``None`` without ``samples``."""
        return None if self.samples is None else self.samples / self.seconds

    @property
    def tflops_per_device(self) -> float | None:
        """Achieved TFLOP/s of one device (the world's FLOPs / devices / seconds)."""
        if self.flops is None:
            return None
        return self.flops / self.num_devices / self.seconds / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved over peak FLOP/s, in [0, 1] when sane."""
        achieved, peak = self.tflops_per_device, self.peak_flops_per_device
        if achieved is None or peak is None:
            return None
        assert isinstance(peak, float | int)
        return achieved * 1e12 / peak

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The known rates as a dict for ``log_metrics`` (absent ones left out).

        >>> Throughput(seconds=0.5, samples=64).metrics()
        {'samples_per_second': 128.0}
        """
        values = {
            "tokens_per_second": self.tokens_per_second,
            "samples_per_second": self.samples_per_second,
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
        }
        return {prefix + k: v for k, v in values.items() if v is not None}

    def describe(self) -> str:
        """The known rates on one line, for a progress display.

        >>> Throughput(seconds=2.0, tokens=5000).describe()
        '2,500 tok/s'
        """
        parts = []
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:,.0f} tok/s")
        if self.samples_per_second is not None:
            parts.append(f"{self.samples_per_second:,.1f} samples/s")
        if self.tflops_per_device is not None:
            parts.append(f"{self.tflops_per_device:.3g} TFLOP/s/device")
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%")
        return ", ".join(parts)


def measure_throughput(
    ctx: DistributedContext,
    *,
    seconds: float,
    tokens: int | torch.Tensor | None = None,
    samples: int | torch.Tensor | None = None,
    flops: float | None = None,
    peak_flops_per_device: float | str | None = None,
) -> Throughput:
    """Build the window's ``Throughput`` from this rank's counts (a collective).

    ``tokens``, ``samples`` and ``flops`` are this rank's totals over the window
    (every micro-batch of it, padding excluded from ``tokens``); they are summed
    over the ranks, and ``seconds`` (this rank's wall time of the window) becomes
    the slowest rank's, since the window ends when it does: one ``gather`` of
    four numbers, which every rank must call. Each process is one device:
    ``num_devices`` is ``ctx.num_processes``. With one process nothing is sent.

    With 2 ranks that scored 30 and 50 tokens in 2.0 and 2.5 seconds, both get
    ``Throughput(seconds=2.5, tokens=80, num_devices=2)``: 32 tokens/s.

    >>> from funcaccel.context import DistributedContext
    >>> measure_throughput(DistributedContext(), seconds=4.0, tokens=100).describe()
    '25 tok/s'

    Raises:
        TypeError, ValueError: see ``Throughput``; a count given on some ranks
            and not on others (on every rank).
        RuntimeError: see ``gather``.
    """
    caller = "measure_throughput"
    check_context(caller, ctx)
    check_type(caller, "seconds", seconds, (int, float))
    row = [
        math.nan if value is None else float(value)
        for value in (tokens, samples, flops)
    ]
    local = torch.tensor([[*row, float(seconds)]], dtype=torch.float64)
    rows = gather(ctx, local) if ctx.num_processes > 1 else local
    summed: list[float | None] = []
    for column, name in zip(rows.T[:3], ("tokens", "samples", "flops"), strict=True):
        missing = column.isnan()
        if bool(missing.any()) and not bool(missing.all()):
            ranks = missing.nonzero().flatten().tolist()
            fail_value(
                caller,
                name,
                f"None on rank(s) {ranks} only",
                "given on every rank or on none",
                "Pass 0 on a rank that processed nothing.",
            )
        summed.append(None if bool(missing.all()) else float(column.sum()))
    return Throughput(
        seconds=float(rows[:, 3].max()),
        tokens=None if summed[0] is None else round(summed[0]),
        samples=None if summed[1] is None else round(summed[1]),
        flops=summed[2],
        num_devices=ctx.num_processes,
        peak_flops_per_device=peak_flops_per_device,
    )
