"""Seeding every random number generator a training script uses, from one call.

``set_seed(ctx, seed)`` seeds Python's ``random``, numpy's global generator (when
numpy is installed), torch's CPU generator and every CUDA device's (when CUDA is
available), as Accelerate's ``set_seed``. It reads the rank from ``ctx`` instead of
a singleton.

>>> import random
>>> ctx = DistributedContext()
>>> set_seed(ctx, 7)
7
>>> a = (random.random(), torch.rand(1).item())
>>> _ = set_seed(ctx, 7)
>>> a == (random.random(), torch.rand(1).item())
True
"""

from __future__ import annotations

import importlib.util
import numbers
import random
from typing import Final

import torch

from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext

__all__ = [
    "set_seed",
]

# The seeds torch.manual_seed accepts: a signed or unsigned 64-bit integer.
SEED_MIN: Final = -(2**63)
SEED_MAX: Final = 2**64 - 1
# numpy's legacy global generator (np.random.seed) takes only 32-bit seeds.
_NUMPY_SEEDS: Final = 2**32


def set_seed(
    ctx: DistributedContext,
    seed: int,
    *,
    device_specific: bool = False,
    deterministic: bool = False,
) -> int:
    """Seed Python, numpy, torch and CUDA with ``seed``; return the seed used.

    Seeds ``random.seed``, ``numpy.random.seed`` (if numpy is installed),
    ``torch.manual_seed`` and ``torch.cuda.manual_seed_all`` (if CUDA is
    available). These are process-wide generators: the call changes them for the
    whole process, not for ``ctx`` alone. numpy's legacy generator takes only
    32-bit seeds, so it gets ``seed % 2**32`` (the same value for the same seed,
    every time).

    Args:
        ctx: the run's context (only ``process_index`` is read).
        seed: an int torch accepts, in ``[-2**63, 2**64 - 1]``.
        device_specific: add ``ctx.process_index`` to ``seed``, so that each rank
            draws different numbers (say, for data augmentation), as Accelerate.
        deterministic: also call ``torch.use_deterministic_algorithms(True)``.
            That switch is process-wide and stays on after the call; ``False``
            leaves it as it is (it does not switch it off). On CUDA some
            operations also need the ``CUBLAS_WORKSPACE_CONFIG`` environment
            variable, which funcaccel never sets: set it before starting.

    Returns:
        The seed the generators got: ``seed``, plus ``ctx.process_index`` with
        ``device_specific=True``.

    Raises:
        TypeError: ``seed`` is not an integer (a bool is not), or a flag is not
            a bool.
        ValueError: the seed (after adding the rank) is outside torch's range.

    Example, with 2 ranks and ``set_seed(ctx, 42, device_specific=True)``: rank 0
    is seeded with 42 and rank 1 with 43; without ``device_specific`` both get 42
    and draw the same numbers.

    >>> set_seed(DistributedContext(), 3, device_specific=True)
    3
    """
    check_context("set_seed", ctx)
    hint = "Pass an int such as 42."
    check_type("set_seed", "seed", seed, numbers.Integral, what="an int", hint=hint)
    check_bool("set_seed", "device_specific", device_specific)
    check_bool("set_seed", "deterministic", deterministic)
    used = int(seed) + (ctx.process_index if device_specific else 0)
    if not SEED_MIN <= used <= SEED_MAX:
        rank = f" + process_index ({int(seed)} + {ctx.process_index})"
        name = "seed" + (rank if device_specific else "")
        what = "in [-2**63, 2**64 - 1], the range torch accepts"
        fail_value("set_seed", name, used, what, "Pass a smaller seed.")
    random.seed(used)
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        np.random.seed(used % _NUMPY_SEEDS)
    torch.manual_seed(used)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(used)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return used
