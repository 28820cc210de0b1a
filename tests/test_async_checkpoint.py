"""save_checkpoint_async(...): staged values, wait(), failures, kills, 2 ranks.

The background writer is held back with an event where a test must change the
model while the files are still being written.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import funcaccel.checkpoint._layout
from funcaccel.checkpoint import PendingCheckpoint
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import list_checkpoints
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
from funcaccel.checkpoint import save_checkpoint_async
from funcaccel.checkpoint._async import DeferredCopy
from funcaccel.context import DistributedContext
from funcaccel.launch import LaunchError
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks

ONE = DistributedContext()
Tensors = dict[str, torch.Tensor]
_write = funcaccel.checkpoint._layout.write_torch_file


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _copy(model: nn.Module) -> Tensors:
    return {k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()}


def _same(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _held_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, list[str]]:
    """Make the background writer wait for the event before each file."""
    release, threads = threading.Event(), []

    def held(obj: object, path: Path) -> tuple[int, str]:
        threads.append(threading.current_thread().name)
        assert release.wait(timeout=60)
        return _write(obj, path)

    monkeypatch.setattr(funcaccel.checkpoint._layout, "write_torch_file", held)
    return release, threads


def test_the_checkpoint_holds_the_staged_values_not_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    _train(model, opt)
    saved_params = _copy(model)
    saved_momentum = [s["momentum_buffer"].clone() for s in opt.state.values()]
    release, threads = _held_writer(monkeypatch)
    pending = save_checkpoint_async(
        ONE, tmp_path, models=model, optimizers=opt, extra={"n": 1}
    )
    assert isinstance(pending, PendingCheckpoint)
    assert pending.path == tmp_path / "checkpoint-000001"
    _train(model, opt, steps=3)  # training goes on while nothing is written yet
    assert not pending.done() and latest_checkpoint(tmp_path) is None
    release.set()
    assert pending.wait() == tmp_path / "checkpoint-000001"
    # a second wait returns too
    assert pending.done() and pending.wait() == pending.path
    assert set(threads) == {"funcaccel-save-checkpoint-000001"}
    assert latest_checkpoint(tmp_path) == pending.path
    fresh, fresh_opt = _model(seed=1)
    loaded = load_checkpoint(ONE, pending.path, models=fresh, optimizers=fresh_opt)
    assert loaded.extra == {"n": 1}
    assert _same(_copy(fresh), saved_params) and not _same(_copy(model), saved_params)
    momentum = [s["momentum_buffer"] for s in fresh_opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, saved_momentum, strict=True))


def test_an_async_checkpoint_has_the_files_and_hashes_of_a_sync_one(
    tmp_path: Path,
) -> None:
    model, opt = _model()
    _train(model, opt)
    sync = save_checkpoint(
        ONE, tmp_path / "sync", models=model, optimizers=opt, save_rng=False
    )
    pending = save_checkpoint_async(
        ONE,
        tmp_path / "async",
        models=model,
        optimizers=opt,
        save_rng=False,
    )
    meta_sync = read_checkpoint_meta(sync, verify=True)
    meta_async = read_checkpoint_meta(pending.wait(), verify=True)
    assert meta_async.files == meta_sync.files  # byte-identical files


def test_the_next_save_completes_a_pending_one_passed_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    release, _ = _held_writer(monkeypatch)
    first = save_checkpoint_async(ONE, tmp_path, models=model)
    with pytest.raises(
        RuntimeError,
        match=r"save_checkpoint: .*an asynchronous save into .* \(checkpoint-000001\) is still pending; pass its PendingCheckpoint as save_checkpoint\(\.\.\., pending=handle\)",
    ):
        save_checkpoint(ONE, tmp_path, models=model)  # forgot the handle: refused
    assert not first.done()  # the refused save touched nothing
    threading.Timer(0.2, release.set).start()
    second = save_checkpoint(ONE, tmp_path, models=model, keep_last=1, pending=first)
    assert first.done() and first.wait() == tmp_path / "checkpoint-000001"
    assert second == tmp_path / "checkpoint-000002" == latest_checkpoint(tmp_path)
    assert list_checkpoints(tmp_path) == [second]
    assert not list(tmp_path.rglob(".async-save-*"))  # no marker left behind


def _staging(pending: PendingCheckpoint) -> set[int]:
    return {b.data_ptr() for b in pending._buffers}


def test_the_next_save_stages_into_the_memory_of_the_one_passed_to_it(
    tmp_path: Path,
) -> None:
    model, opt = _model()
    _train(model, opt)
    before = _copy(model)
    first = save_checkpoint_async(ONE, tmp_path, models=model, optimizers=opt)
    memory = _staging(first)
    _train(model, opt)  # the next window changes every parameter and momentum
    after = _copy(model)
    second = save_checkpoint_async(
        ONE, tmp_path, models=model, optimizers=opt, pending=first
    )
    assert _staging(second) == memory and first._buffers == ()  # reused, handed on
    # Another layout (a second model) cannot reuse it: fresh memory, right values.
    other, _ = _model(seed=1)
    third = save_checkpoint_async(
        ONE,
        tmp_path,
        models=[model, other],
        optimizers=opt,
        pending=second,
    )
    assert not _staging(third) & memory
    paths = [first.wait(), second.wait(), third.wait()]
    for path, (expected, extra) in zip(
        paths, [(before, None), (after, None), (after, other)], strict=True
    ):
        fresh, fresh_opt = _model(seed=2)
        models = [fresh] if extra is None else [fresh, _model(seed=3)[0]]
        load_checkpoint(ONE, path, models=models, optimizers=fresh_opt)
        assert _same(_copy(fresh), expected)
        if extra is not None:
            assert _same(_copy(models[1]), _copy(extra))


def test_a_marker_left_by_a_killed_process_does_not_block_the_next_save(
    tmp_path: Path,
) -> None:
    model, _ = _model()
    stale = tmp_path / ".checkpoint-000001.tmp"
    stale.mkdir(parents=True)
    (stale / ".async-save-otherhost-1").touch()
    assert (
        save_checkpoint(ONE, tmp_path, models=model) == tmp_path / "checkpoint-000001"
    )


def test_a_background_failure_is_raised_by_wait_and_the_previous_stays_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    previous = save_checkpoint(ONE, tmp_path, models=model)

    def failing(obj: object, path: Path) -> tuple[int, str]:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(funcaccel.checkpoint._layout, "write_torch_file", failing)
    pending = save_checkpoint_async(ONE, tmp_path, models=model)
    with pytest.raises(
        RuntimeError,
        match=r"save_checkpoint_async: the checkpoint was not written \(the previous one is still the latest\); rank 0: writing into .*checkpoint-000002.tmp failed in the background: OSError: disk full",
    ) as raised:
        pending.wait()
    assert isinstance(raised.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="disk full"):
        pending.wait()  # the same failure again, no second commit
    assert latest_checkpoint(tmp_path) == previous
    monkeypatch.setattr(funcaccel.checkpoint._layout, "write_torch_file", _write)
    assert (
        save_checkpoint(ONE, tmp_path, models=model) == tmp_path / "checkpoint-000002"
    )


# --- what only the optimizers change is copied after the return -------------------


def _held_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the background copy of optimizer-owned tensors wait for the event."""
    release = threading.Event()
    original = DeferredCopy.run

    def held(self: DeferredCopy) -> None:
        assert release.wait(timeout=60)
        original(self)

    monkeypatch.setattr(DeferredCopy, "run", held)
    return release


def _bn_model(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_a_step_waits_for_the_copy_and_forward_backward_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _bn_model()
    _train(model, opt)
    saved = _copy(model)
    saved_state = {
        k: v.clone() for k, v in opt.state[model.get_parameter("0.weight")].items()
    }
    release = _held_copy(monkeypatch)
    pending = save_checkpoint_async(ONE, tmp_path, models=model, optimizers=opt)
    assert "staging" in repr(pending)
    # The next micro-step's forward and backward run while the copy is held: the
    # BatchNorm running statistics (no optimizer changes them) were copied already.
    model(torch.randn(4, 3)).square().mean().backward()
    stepped = threading.Event()

    def step() -> None:
        opt.step()
        stepped.set()

    stepper = threading.Thread(target=step)
    stepper.start()
    assert not stepped.wait(timeout=0.3)  # the step waits for the copy
    assert torch.equal(model.get_parameter("0.weight"), saved["0.weight"])
    release.set()
    assert stepped.wait(timeout=60)
    stepper.join()
    path = pending.wait()
    assert not opt._optimizer_step_pre_hooks  # no hook left behind
    fresh, fresh_opt = _bn_model(seed=1)
    load_checkpoint(ONE, path, models=fresh, optimizers=fresh_opt)
    assert _same(_copy(fresh), saved)  # before the forward and the step
    assert not torch.equal(model.get_buffer("1.running_mean"), saved["1.running_mean"])
    assert not torch.equal(model.get_parameter("0.weight"), saved["0.weight"])
    loaded_state = fresh_opt.state[fresh.get_parameter("0.weight")]
    assert all(torch.equal(loaded_state[k], v) for k, v in saved_state.items())


def test_an_in_place_change_before_the_copy_fails_the_save_not_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    _train(model, opt)
    previous = save_checkpoint(ONE, tmp_path, models=model, optimizers=opt)
    release = _held_copy(monkeypatch)
    pending = save_checkpoint_async(ONE, tmp_path, models=model, optimizers=opt)
    last_bias = list(model.parameters())[-1]  # the state dict's 2.bias
    with torch.no_grad():
        last_bias.add_(1.0)  # not through the optimizer: nothing waits
    release.set()
    with pytest.raises(
        RuntimeError,
        match=r"save_checkpoint_async: the checkpoint was not written \(the previous one is still the latest\); rank 0: staging .*checkpoint-000002.tmp failed in the background: model_0.pt/2.bias changed in place after save_checkpoint_async returned but before the background copy of it had finished, .* or call handle.wait_staged\(\) before changing them otherwise",
    ):
        pending.wait()
    assert latest_checkpoint(tmp_path) == previous
    assert not opt._optimizer_step_pre_hooks
    # The same change after wait_staged() is safe, and the save holds the old value.
    before = _copy(model)
    pending = save_checkpoint_async(ONE, tmp_path, models=model, optimizers=opt)
    pending.wait_staged()
    with torch.no_grad():
        last_bias.add_(1.0)
    fresh, fresh_opt = _model(seed=1)
    load_checkpoint(ONE, pending.wait(), models=fresh, optimizers=fresh_opt)
    assert _same(_copy(fresh), before)


def test_without_optimizers_everything_is_copied_before_the_return(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    release = _held_copy(monkeypatch)  # would hang a deferred copy; none is made
    release.set()
    saved = _copy(model)
    pending = save_checkpoint_async(ONE, tmp_path, models=model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # changed at once: the copy was made before the return
    fresh, _ = _model(seed=1)
    load_checkpoint(ONE, pending.wait(), models=fresh)
    assert _same(_copy(fresh), saved)
    assert not opt._optimizer_step_pre_hooks


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keep_last": 0}, ValueError, r"keep_last must be an int >= 1 or None; got 0"),
        ({"save_rng": 1}, TypeError, r"save_rng must be a bool; got 1 \(int\)"),
        ({"pending": "handle"}, TypeError, r"pending must be the PendingCheckpoint"),
    ],
)
def test_save_checkpoint_async_checks_its_arguments_under_its_own_name(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match="^save_checkpoint_async: " + match):
        save_checkpoint_async(ONE, tmp_path, models=nn.Linear(1, 1), **kwargs)
    assert not tmp_path.joinpath("checkpoint-000001").exists()


@pytest.mark.parametrize("flag", [True, 1])
def test_save_checkpoint_refuses_asynchronous_and_names_save_checkpoint_async(
    tmp_path: Path, flag: object
) -> None:
    with pytest.raises(
        ValueError,
        match=r"save_checkpoint: asynchronous must be False; got (True|1)\. Call "
        r"save_checkpoint_async\(ctx, directory, \.\.\.\) for a background save",
    ):
        save_checkpoint(ONE, tmp_path, models=nn.Linear(1, 1), asynchronous=flag)  # type: ignore[arg-type]
    assert not tmp_path.joinpath("checkpoint-000001").exists()


# --- a process killed while the background thread writes ---------------------------


def _async_save_then_die(ctx: DistributedContext, root: Path) -> None:
    del ctx  # one process: ONE (its group of one is not used)
    model, _ = _model()
    save_checkpoint(ONE, root, models=model, extra={"which": "first"})

    def dying_write(obj: object, path: Path) -> tuple[int, str]:
        _write(obj, path)
        path.write_bytes(path.read_bytes()[:64])  # the kill cut the file short
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    funcaccel.checkpoint._layout.write_torch_file = dying_write
    pending = save_checkpoint_async(ONE, root, models=model, extra={"which": "second"})
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=100)
    pending.wait()


@pytest.mark.distributed
def test_a_kill_during_an_async_write_leaves_the_previous_checkpoint_latest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    with pytest.raises(LaunchError, match="rank 0 of 1 was killed by signal 9"):
        run_ranks(_async_save_then_die, 1, root, start_method="forkserver")
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "checkpoint-000001"
    model, _ = _model(seed=3)
    assert load_checkpoint(ONE, latest, models=model).extra == {"which": "first"}
    assert [p.name for p in list_checkpoints(root)] == ["checkpoint-000001"]
    assert (root / ".checkpoint-000002.tmp").is_dir()
    after = save_checkpoint(ONE, root, models=model)
    assert after.name == "checkpoint-000002" and latest_checkpoint(root) == after


# --- 2 gloo processes -------------------------------------------------------------


def _ddp_async(ctx: DistributedContext, root: Path, fsdp: bool) -> dict[str, object]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    model = wrap_model(ctx, net, fsdp=FSDPOptions()) if fsdp else wrap_model(ctx, net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(ctx.process_index)
    _train(model, opt)
    staged = _full(model)
    # DCP's writing of the sharded part is held until this rank has trained on:
    # it must run off the training thread (a synchronous write would time out).
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    trained, writers = threading.Event(), []
    write_data = FileSystemWriter.write_data

    def held(self: FileSystemWriter, *args: Any) -> Any:
        writers.append((threading.current_thread().name, trained.wait(timeout=30)))
        return write_data(self, *args)

    FileSystemWriter.write_data = held  # type: ignore[method-assign, assignment]
    pending = save_checkpoint_async(ctx, root, models=model, optimizers=opt)
    _train(model, opt, steps=2)  # every rank trains on before waiting
    trained.set()
    path = pending.wait()
    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    torch.manual_seed(7)
    fresh_net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    fresh = (
        wrap_model(ctx, fresh_net, fsdp=FSDPOptions())
        if fsdp
        else wrap_model(ctx, fresh_net)
    )
    load_checkpoint(
        ctx, path, models=fresh, optimizers=torch.optim.SGD(fresh.parameters(), lr=0.1)
    )
    loaded = _full(fresh)
    return {"path": path, "staged": staged, "loaded": loaded, "writers": writers}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in unwrap_model(model).state_dict().items()
    }


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_save_asynchronously_and_wait_on_each(
    tmp_path: Path, fsdp: bool
) -> None:
    root = tmp_path / "run"
    results = run_ranks(_ddp_async, 2, root, fsdp, start_method="forkserver")
    for result in results:
        assert result["path"] == root / "checkpoint-000001"
        assert _same(result["loaded"], result["staged"])  # type: ignore[arg-type]
        writers: list[tuple[str, bool]] = result["writers"]  # type: ignore[assignment]
        if fsdp:  # DCP wrote in its thread, released only after the training steps
            assert len(writers) == 1, writers
            assert writers[0][0] != "MainThread" and writers[0][1], writers
        else:
            assert writers == []  # no DCP for DDP
    meta = read_checkpoint_meta(root / "checkpoint-000001", verify=True)
    assert {"rng_rank_0.pt", "rng_rank_1.pt"} <= set(meta.files)
    assert meta.state_format == ("dcp" if fsdp else "torch")
