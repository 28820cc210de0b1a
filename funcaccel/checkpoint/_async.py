"""Asynchronous checkpoints: staged in CPU memory, written in a thread, committed in wait().

``save_checkpoint_async`` copies the state to be written
(``stage``: a deep copy, every tensor cloned onto the CPU) and returns a
``PendingCheckpoint`` while a background thread writes and fsyncs this rank's
files. The CPU tensors that only the saved optimizers' steps change
(``optimizer_storages``) are copied by that thread first (``DeferredCopy``), while
the loop's next forward and backward run; a step pre-hook on each saved
optimizer waits for that copy, and each such tensor's version counter, compared
after its copy, turns an in-place change made meanwhile into a failed save.
``PendingCheckpoint.wait()`` joins the thread; then the ranks agree that all
of them wrote, and rank 0 writes the manifest, renames the directory into place
and moves ``latest``, exactly as a synchronous save ends. The thread never
communicates, so it cannot interleave with the training loop's collectives.

No registry of pending saves is kept: the caller threads the handle, passing it
to the next ``save_checkpoint_async(..., pending=handle)`` (which completes it first)
or calling ``handle.wait()``. While a save is pending, rank 0 keeps a marker file
naming this host and process in its temporary directory, so that a next save
into the same directory that forgot the handle is refused (it would otherwise
take the same number and delete the files being written), while a marker a
killed process left behind is recognised as stale and cleaned up.

>>> state = {"w": torch.ones(2)}
>>> staged, buffers, _ = stage(state)
>>> _ = state["w"].add_(1)  # training goes on
>>> staged["w"].tolist()
[1.0, 1.0]
>>> again, _, _ = stage(state, buffers)  # the next save: the same memory, refilled
>>> again["w"].tolist(), again["w"].untyped_storage().data_ptr() == buffers[0].data_ptr()
([2.0, 2.0], True)
"""

from __future__ import annotations

import copy
import os
import socket
import threading
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import torch
from torch import nn

from funcaccel._checks import type_name
from funcaccel._guard import guard_collective
from funcaccel.checkpoint._manifest import FileEntry
from funcaccel.context import DistributedContext

__all__ = [
    "DeferredCopy",
    "PendingCheckpoint",
    "optimizer_storages",
    "own_pending_save",
    "stage",
    "storage_key",
    "take_buffers",
]

Finish = Callable[[dict[str, FileEntry], str | None], Path]
_MARKER: Final = ".async-save-"
_MSG_TORN: Final = (
    "{} changed in place after save_checkpoint_async returned but before the "
    "background copy of it had finished, so the copy may mix old and new values; "
    "change the saved tensors only through the saved optimizers' step() (which "
    "waits for the copy), or call handle.wait_staged() before changing them otherwise"
)


def _marker_name() -> str:
    return f"{_MARKER}{socket.gethostname()}-{os.getpid()}"


def own_pending_save(root: Path) -> str | None:
    """Return the name of a save into ``root`` this process has not completed.

    A temporary checkpoint directory holding this host's and process's marker is
    one; a marker of another process is a leftover of a killed run (None).
    """
    if not root.is_dir():
        return None
    mine = _marker_name()
    for entry in root.iterdir():
        if (
            entry.name.startswith(".")
            and entry.name.endswith(".tmp")
            and entry.is_dir()
        ):
            if not entry.is_symlink() and (entry / mine).is_file():
                return entry.name[1:].removesuffix(".tmp")
    return None


def _tensors(value: object, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{path}/{key}" if path else str(key))
    elif isinstance(value, (list, tuple, set)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}/{i}")


StorageKey = tuple[torch.device, int]


def storage_key(tensor: torch.Tensor) -> StorageKey:
    """Identify ``tensor``'s storage (views of one storage share the key)."""
    return (tensor.device, tensor.untyped_storage().data_ptr())


def optimizer_storages(
    optimizers: Sequence[torch.optim.Optimizer],
) -> frozenset[StorageKey]:
    """Return the CPU storages only ``optimizers``' steps change: parameters and state.

    These are what an asynchronous save may copy after it returns, while the
    loop's next forward and backward run: each optimizer's step waits for it.
    """
    owned: list[torch.Tensor] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            owned.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
        for per_param in optimizer.state.values():
            owned.extend(tensor for _, tensor in _tensors(per_param))
    # Plain CPU tensors only (a DTensor's state goes through DCP before the return).
    return frozenset(
        storage_key(t)
        for t in owned
        if type(t) in (torch.Tensor, nn.Parameter)
        and t.layout == torch.strided
        and t.device.type == "cpu"
    )


class DeferredCopy:
    """The part of a staged copy made after ``save_checkpoint_async`` has returned.

    Holds pairs of (source storage's bytes, staged bytes) and, for every tensor
    of the state in those storages, its version counter at the save: ``run()``
    copies, then refuses (``RuntimeError``) a copy that an in-place change made
    in the meantime may have torn. An optimizer's step cannot be one: it waits
    for the copy.
    """

    def __init__(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        versions: list[tuple[str, torch.Tensor, int]],
    ) -> None:
        self._pairs = pairs
        self._versions = versions

    def __len__(self) -> int:
        return len(self._pairs)

    def run(self) -> None:
        """Copy every deferred storage; raise if a source changed before its copy."""
        for source, target in self._pairs:
            target.copy_(source)
        changed = [
            name
            for name, tensor, version in self._versions
            if tensor._version != version
        ]
        self._pairs, self._versions = [], []
        if changed:
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise RuntimeError(_MSG_TORN.format(", ".join(changed[:5]) + more))


def stage(
    files: dict[str, object],
    buffers: Sequence[torch.UntypedStorage] = (),
    *,
    defer: frozenset[StorageKey] = frozenset(),
) -> tuple[dict[str, object], tuple[torch.UntypedStorage, ...], DeferredCopy]:
    """Return a deep copy of ``files`` whose tensors are CPU copies, and their storages.

    Tensors that shared memory share it in the copy too (one storage copied once),
    so ``torch.save`` writes the copy exactly as it would the original. Each
    source storage is copied as bytes into one CPU storage; ``buffers`` (what an
    earlier ``stage`` returned, once nothing reads that copy any more) are reused
    in order instead of allocating when the state has the same storages and byte
    sizes, which saves the allocation and its page faults on every save after
    the first. Otherwise fresh storages are allocated (pinned for CUDA sources).

    Storages in ``defer`` are not copied yet: the returned ``DeferredCopy`` copies
    them (the copy's tensors already point at their memory). Everything else is
    copied before this returns.
    """
    sources: list[torch.Tensor] = []
    seen: set[StorageKey] = set()
    for _, tensor in _tensors(files):
        if tensor.layout == torch.strided and type(tensor) is torch.Tensor:
            source = tensor.untyped_storage()
            key = storage_key(tensor)
            if key not in seen:
                seen.add(key)
                raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
                raw.set_(source, 0, (source.nbytes(),), (1,))
                sources.append(raw)
    reuse = len(buffers) == len(sources) and all(
        b.device.type == "cpu" and b.nbytes() == s.numel()
        for b, s in zip(buffers, sources, strict=True)
    )
    copies: dict[StorageKey, torch.UntypedStorage] = {}
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, raw in enumerate(sources):
        if reuse:
            target = torch.empty(0, dtype=torch.uint8)
            target.set_(buffers[i], 0, (raw.numel(),), (1,))
        else:
            pinned = raw.device.type == "cuda"
            target = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=pinned)
        key = storage_key(raw)
        if key in defer:
            later.append((raw, target))
        else:
            target.copy_(raw)  # the whole storage, in one go
        copies[key] = target.untyped_storage()
    memo: dict[int, object] = {}
    versions: list[tuple[str, torch.Tensor, int]] = []
    for name, tensor in _tensors(files):
        if id(tensor) in memo:
            continue
        if tensor.layout != torch.strided or type(tensor) is not torch.Tensor:
            memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
            continue
        key = storage_key(tensor)
        if key in defer:
            versions.append((name, tensor, tensor._version))
        copied = torch.empty(0, dtype=tensor.dtype)
        copied.set_(
            copies[key], tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        memo[id(tensor)] = copied
    staged: dict[str, object] = copy.deepcopy(files, memo)
    return staged, tuple(copies.values()), DeferredCopy(later, versions)


class PendingCheckpoint:
    """A checkpoint whose files are being written in the background.

    Returned by ``save_checkpoint_async`` on every rank. Until
    ``wait()`` has run (on every rank), the checkpoint is not complete and
    ``latest`` still names the previous one.

    Attributes:
        path: where the checkpoint will be once complete, ``directory/checkpoint-N``.
    """

    def __init__(
        self,
        ctx: DistributedContext,
        path: Path,
        write: Callable[[], dict[str, FileEntry]],
        finish: Finish,
        *,
        error: str | None = None,
        buffers: tuple[torch.UntypedStorage, ...] = (),
        deferred: DeferredCopy | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        sharded_done: Callable[[], str | None] | None = None,
    ) -> None:
        self.path = path
        self._buffers = buffers  # the staged copy's memory, for the next save
        self._ctx = ctx
        self._finish = finish
        self._entries: dict[str, FileEntry] = {}
        self._error = error  # staging failed: nothing to write
        self._cause: BaseException | None = None
        self._outcome: Path | BaseException | None = None
        self._staged = threading.Event()
        self._sharded_done = sharded_done  # DCP's own background save, if any
        where = path.parent / f".{path.name}.tmp"  # the temporary directory

        def run() -> None:
            try:
                if self._error is None and deferred is not None:
                    deferred.run()
            except Exception as failure:
                self._error = f"staging {where} failed in the background: {failure}"
                self._cause = failure
            finally:
                self._staged.set()  # optimizers' steps may go on, whatever happened
            if self._error is not None:
                return
            try:
                self._entries = write()
            except Exception as failure:  # any failure is reported by wait()
                self._error = f"writing into {where} failed in the background: {type_name(failure)}: {failure}"
                self._cause = failure

        # Until the deferred copy is made, a step of a saved optimizer (the only
        # code that changes what is deferred) waits for it.
        self._hooks = (
            [opt.register_step_pre_hook(self._hold) for opt in optimizers]
            if deferred
            else []
        )
        self._thread = threading.Thread(
            target=run, name=f"funcaccel-save-{path.name}", daemon=False
        )
        self._marker = where / _marker_name()
        if ctx.is_main_process and self._error is None:
            self._marker.touch()
        self._thread.start()

    def _hold(self, optimizer: object, args: object, kwargs: object) -> None:
        self._staged.wait()

    def done(self) -> bool:
        """Return whether this rank's own background writing has finished (no waiting, not collective).

        The sharded (``dcp/``) part of an FSDP2 or mesh model is written by DCP's
        thread, which ``wait()`` joins.
        """
        return not self._thread.is_alive()

    def wait_staged(self) -> None:
        """Block until the state is copied into CPU memory (not collective).

        After it, the saved tensors may be changed in any way. A step of a saved
        optimizer waits for this by itself; call it before changing saved tensors
        by other means (``load_state_dict``, in-place edits, an EMA update of a
        saved model) while the save is pending.
        """
        self._staged.wait()

    def wait(self) -> Path:
        """Finish the save: join the writer, then commit (collective, every rank).

        Every rank must call it, or pass the handle to the next
        ``save_checkpoint_async(..., pending=handle)``, which calls it. A second call returns (or raises) as the first.

        Returns:
            The complete checkpoint's path, now named by ``directory/latest``.

        Raises:
            RuntimeError: a rank's background writing failed (its error is
                chained), or committing failed; raised on every rank, and the
                previous checkpoint stays current.
        """
        if self._outcome is None:
            self._thread.join()
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            if self._sharded_done is not None:
                sharded_error = self._sharded_done()
                self._sharded_done = None
                self._error = self._error or sharded_error
            try:
                if self._ctx.is_main_process:
                    self._marker.unlink(missing_ok=True)
                guard_collective(self._ctx, "PendingCheckpoint.wait")
                self._outcome = self._finish(self._entries, self._error)
            except BaseException as failure:
                self._outcome = failure
                if self._cause is not None and failure.__cause__ is None:
                    failure.__cause__ = self._cause
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "written"
        if not self._staged.is_set():
            state = "staging"
        if self._outcome is not None:
            state = "failed" if isinstance(self._outcome, BaseException) else "complete"
        return f"PendingCheckpoint(path={str(self.path)!r}, {state})"


def take_buffers(pending: PendingCheckpoint) -> tuple[torch.UntypedStorage, ...]:
    """Hand a completed save's staging memory to the next save (once; then empty).

    Call it only after ``pending.wait()``: the writer no longer reads the copy.
    """
    if not pending.done():
        msg = "take_buffers: the save is still being written; call wait() first"
        raise RuntimeError(msg)
    buffers, pending._buffers = pending._buffers, ()
    return buffers
