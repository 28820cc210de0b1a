"""Capture and restore this process's random-number generators for a checkpoint.

A checkpoint stores one RNG file per rank, so that dropout and random augmentation
continue exactly where they stopped. The state is a plain dict of tensors, lists and
ints that ``torch.load(..., weights_only=True)`` can read back:

- ``"python"``: Python's ``random`` module;
- ``"torch"``: torch's default CPU generator;
- ``"cuda"``: every CUDA device's generator, when CUDA is available;
- ``"numpy"``: NumPy's legacy global generator (``numpy.random.seed``), when NumPy
  is installed.

>>> import random
>>> state = capture_rng_state()
>>> first = (random.random(), torch.rand(1).item())
>>> restore_rng_state(state, caller="example")[:2]
('python', 'torch')
>>> (random.random(), torch.rand(1).item()) == first
True
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Final

import torch

from funcaccel._checks import type_name

__all__ = ["RNG_KINDS", "capture_rng_state", "restore_rng_state"]

RNG_KINDS: Final = ("python", "torch", "cuda", "numpy")
"""The generators a checkpoint can hold, in the order they are restored."""


def _python_state() -> dict[str, object]:
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": list(internal), "gauss": gauss}


def _numpy_state() -> dict[str, object] | None:
    try:
        import numpy
    except ImportError:  # NumPy is optional: a run without it has no NumPy RNG.
        return None
    state = numpy.random.get_state(legacy=False)
    inner = state["state"]
    return {
        "bit_generator": str(state["bit_generator"]),
        "key": torch.from_numpy(inner["key"].astype(numpy.int64)),
        "pos": int(inner["pos"]),
        "has_gauss": int(state["has_gauss"]),
        "gauss": float(state["gauss"]),
    }


def capture_rng_state() -> dict[str, object]:
    """Return this process's generator states as a new dict (nothing is changed).

    Returns:
        A dict with ``"python"`` and ``"torch"``, plus ``"cuda"`` when CUDA is
        available and ``"numpy"`` when NumPy is installed.
    """
    state: dict[str, object] = {
        "python": _python_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    return state


def _bad_state(caller: str, kind: str, value: object) -> ValueError:
    msg = (
        f"{caller}: the saved {kind!r} RNG state is malformed (got "
        f"{type_name(value)}); the rank's RNG file is damaged or was not written "
        "by funcaccel. Load another checkpoint or pass restore_rng=False."
    )
    return ValueError(msg)


def _restore_python(value: object, caller: str) -> None:
    if not isinstance(value, Mapping) or set(value) != {"version", "internal", "gauss"}:
        raise _bad_state(caller, "python", value)
    internal = value["internal"]
    if not isinstance(internal, list) or not all(type(x) is int for x in internal):
        raise _bad_state(caller, "python", internal)
    try:
        random.setstate((value["version"], tuple(internal), value["gauss"]))
    except (TypeError, ValueError) as error:
        raise _bad_state(caller, "python", value) from error


def _restore_numpy(value: object, caller: str) -> bool:
    try:
        import numpy
    except ImportError:  # Saved with NumPy, resumed without it: nothing to restore.
        return False
    if not isinstance(value, Mapping) or not isinstance(value.get("key"), torch.Tensor):
        raise _bad_state(caller, "numpy", value)
    state = {
        "bit_generator": value.get("bit_generator"),
        "state": {
            "key": value["key"].numpy().astype(numpy.uint32),
            "pos": value.get("pos"),
        },
        "has_gauss": value.get("has_gauss"),
        "gauss": value.get("gauss"),
    }
    try:
        numpy.random.set_state(state)
    except (KeyError, TypeError, ValueError) as error:
        raise _bad_state(caller, "numpy", value) from error
    return True


def _restore_cuda(value: object, caller: str) -> bool:
    if not torch.cuda.is_available():  # Saved on GPU, resumed on CPU.
        return False
    if not isinstance(value, list) or not all(
        isinstance(t, torch.Tensor) for t in value
    ):
        raise _bad_state(caller, "cuda", value)
    if len(value) != torch.cuda.device_count():
        # One generator per device: another device count has no exact mapping, so
        # only the devices both runs have are restored.
        for index in range(min(len(value), torch.cuda.device_count())):
            torch.cuda.set_rng_state(value[index], index)
        return True
    torch.cuda.set_rng_state_all(value)
    return True


def restore_rng_state(state: Mapping[str, object], *, caller: str) -> tuple[str, ...]:
    """Set this process's generators to ``state`` in place, as far as this run has them.

    ``"cuda"`` is skipped without CUDA and ``"numpy"`` without NumPy; a generator this
    run has but ``state`` lacks keeps its current state.

    Args:
        state: a dict from ``capture_rng_state`` (possibly after a save/load).
        caller: the public function, for error messages.

    Returns:
        The names of the generators that were restored, in ``RNG_KINDS`` order.

    Raises:
        ValueError: ``state`` has an unknown key or a malformed entry.
    """
    unknown = sorted(str(key) for key in set(state) - set(RNG_KINDS))
    if unknown:
        msg = (
            f"{caller}: the RNG state has unknown generators {unknown}; expected some "
            f"of {list(RNG_KINDS)}. The file was not written by this funcaccel; load "
            "another checkpoint or pass restore_rng=False."
        )
        raise ValueError(msg)
    restored: list[str] = []
    if "python" in state:
        _restore_python(state["python"], caller)
        restored.append("python")
    if "torch" in state:
        value = state["torch"]
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
            raise _bad_state(caller, "torch", value)
        torch.set_rng_state(value)
        restored.append("torch")
    if "cuda" in state and _restore_cuda(state["cuda"], caller):
        restored.append("cuda")
    if "numpy" in state and _restore_numpy(state["numpy"], caller):
        restored.append("numpy")
    return tuple(restored)
