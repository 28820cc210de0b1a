"""main_process_first, local_main_process_first, print_main and get_logger.

Ordering across real processes is checked with wall-clock stamps written by each
rank (one machine, so one clock) and with a log file every rank appends to.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import funcaccel as fa
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.testing import run_ranks

ONE = DistributedContext()
RANK1 = DistributedContext(
    num_processes=2, process_index=1, distributed_type=DistributedType.MULTI_CPU
)
REPO = Path(__file__).resolve().parent.parent


def test_main_process_first_runs_the_body_at_one_process() -> None:
    ran = []
    with fa.main_process_first(ONE):
        ran.append("main")
    with fa.local_main_process_first(ONE):
        ran.append("local")
    assert ran == ["main", "local"]


def test_main_process_first_lets_an_exception_through_at_one_process() -> None:
    with pytest.raises(KeyError, match="boom"), fa.main_process_first(ONE):
        raise KeyError("boom")


def test_main_first_blocks_need_a_group_with_several_processes() -> None:
    for fn in (fa.main_process_first, fa.local_main_process_first):
        with pytest.raises(RuntimeError, match=rf"^{fn.__name__}: ctx has"):
            fn(RANK1)
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: ctx must be"):
            fn(None)  # type: ignore[arg-type]


def test_print_main_prints_on_the_main_process_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fa.print_main(ONE, "a", 1, sep="|", end="!\n")
    fa.print_main(RANK1, "not printed")
    assert capsys.readouterr().out == "a|1!\n"
    buffer = io.StringIO()
    fa.print_main(ONE, "to a file", file=buffer, flush=True)
    assert buffer.getvalue() == "to a file\n"


def _records(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_get_logger_logs_on_the_main_process_unless_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = "tests.process.gating"
    caplog.set_level(logging.INFO, logger=name)
    main, other = fa.get_logger(ONE, name), fa.get_logger(RANK1, name)
    main.info("main %d", 1)
    other.info("rank 1 default")
    other.warning("rank 1 everywhere", main_process_only=False)
    other.error("rank 1 in order only", in_order=True)  # main only: no barrier
    main.debug("below the level", main_process_only=False)
    assert _records(caplog, name) == ["main 1", "rank 1 everywhere"]


def test_get_logger_records_name_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    name = "tests.process.caller"
    caplog.set_level(logging.INFO, logger=name)
    log = fa.get_logger(ONE, name)
    log.info("via info")
    log.log(logging.WARNING, "via log", main_process_only=False)
    try:
        raise ValueError("inside")
    except ValueError:
        log.exception("via exception")
    records = [r for r in caplog.records if r.name == name]
    assert [r.funcName for r in records] == [
        "test_get_logger_records_name_the_caller"
    ] * 3
    assert records[2].exc_info is not None and records[2].levelno == logging.ERROR


def test_get_logger_in_order_needs_a_group_for_several_processes() -> None:
    log = fa.get_logger(RANK1, "tests.process.order")
    with pytest.raises(RuntimeError, match=r"^get_logger: ctx has num_processes=2"):
        log.info("x", main_process_only=False, in_order=True)


def test_get_logger_log_level_sets_only_the_named_logger() -> None:
    name = "tests.process.level"
    root_level = logging.getLogger().level
    logger = logging.getLogger(name)
    try:
        fa.get_logger(ONE, name, log_level="debug")
        assert logger.level == logging.DEBUG
        fa.get_logger(ONE, name, log_level=logging.ERROR)
        assert logger.level == logging.ERROR
        assert logging.getLogger().level == root_level
        fa.get_logger(ONE, name)
        assert logger.level == logging.ERROR  # None leaves it alone
    finally:
        logger.setLevel(logging.NOTSET)


def test_get_logger_checks_its_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"^get_logger: log_level must be one of .*got 'loud'"
    ):
        fa.get_logger(ONE, "x", log_level="loud")
    with pytest.raises(TypeError, match=r"^get_logger: log_level must be .*got True"):
        fa.get_logger(ONE, "x", log_level=True)
    with pytest.raises(TypeError, match=r"^get_logger: name must be a str; got 3"):
        fa.get_logger(ONE, 3)  # type: ignore[arg-type]
    log = fa.get_logger(ONE, "tests.process.args")
    with pytest.raises(TypeError, match=r"main_process_only must be a bool; got 'no'"):
        log.info("x", main_process_only="no")
    with pytest.raises(TypeError, match=r"in_order must be a bool; got 1 \(int\)"):
        log.info("x", in_order=1)


def test_importing_funcaccel_adds_no_logging_handler() -> None:
    code = (
        "import logging\n"
        "def handlers():\n"
        "    loggers = logging.Logger.manager.loggerDict.items()\n"
        "    return {(n, id(h)) for n, l in loggers\n"
        "            if isinstance(l, logging.Logger) for h in l.handlers}\n"
        "import torch, torch.distributed\n"  # torch adds its own
        "before = handlers()\n"
        "import funcaccel\n"
        "funcaccel.get_logger(funcaccel.DistributedContext(), 'funcaccel.x')\n"
        "print(len(logging.getLogger().handlers), sorted(handlers() - before))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "0 []"


# ---- real processes --------------------------------------------------------


def _stamp(log_dir: Path, rank: int, what: str) -> None:
    with (log_dir / f"rank{rank}.txt").open("a") as f:
        f.write(f"{what} {time.time()!r}\n")


def _caught(fn: Any) -> Any:
    try:
        return fn()
    except Exception as error:
        return type(error).__name__, str(error)


def _scenarios(ctx: DistributedContext, log_dir: Path) -> dict[str, Any]:
    rank, world = ctx.process_index, ctx.num_processes
    out: dict[str, Any] = {}

    # main_process_first: rank 0 and the last rank are slow in the body.
    with fa.main_process_first(ctx):
        _stamp(log_dir, rank, "main-first body start")
        if rank in (0, world - 1):
            time.sleep(0.3)
        _stamp(log_dir, rank, "main-first body end")
    _stamp(log_dir, rank, "main-first left")

    # local_main_process_first with two "machines": local ranks 0, 1, 0, ...
    two_machines = dataclasses.replace(ctx, local_process_index=rank % 2)
    with fa.local_main_process_first(two_machines):
        _stamp(log_dir, rank, "local-first body start")
        if rank % 2 == 0:
            time.sleep(0.3)
        _stamp(log_dir, rank, "local-first body end")
    _stamp(log_dir, rank, "local-first left")

    # A body that raises on the main process: the others do not run it.
    ran: list[int] = []

    def main_fails() -> None:
        with fa.main_process_first(ctx):
            ran.append(rank)
            if rank == 0:
                raise ValueError("main failed")

    out["main fails"] = (_caught(main_fails), ran)

    def other_fails() -> None:
        with fa.main_process_first(ctx):
            if rank == 1:
                raise KeyError("rank 1 failed")

    out["other fails"] = _caught(other_fails)

    # print_main prints on rank 0 only.
    buffer = io.StringIO()
    fa.print_main(ctx, "hello", rank, file=buffer)
    out["printed"] = buffer.getvalue()

    # get_logger: every rank appends to one file.
    name = "tests.process.shared"
    handler = logging.FileHandler(log_dir / "shared.log", mode="a")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.propagate = False
    log = fa.get_logger(ctx, name, log_level="info")
    try:
        log.info("default from %d", rank)
        # Later ranks reach the call first; in_order still writes 0, 1, 2.
        time.sleep(0.2 * (world - 1 - rank))
        log.info("ordered from %d", rank, main_process_only=False, in_order=True)
        if rank == 1:
            logger.setLevel(logging.ERROR)  # disabled here: still no hang
        log.info("ordered again from %d", rank, main_process_only=False, in_order=True)
        log.error("mark %d", rank, main_process_only=False, in_order=True)
    finally:
        logger.removeHandler(handler)
        handler.close()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def dist_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]], Path]:
    world: int = request.param
    base = tmp_path_factory.mktemp(f"process{world}")
    log_dir = base / "log"
    log_dir.mkdir()
    return (
        world,
        run_ranks(_scenarios, world, log_dir, start_method="forkserver"),
        log_dir,
    )


def _stamps(log_dir: Path, world: int) -> list[dict[str, float]]:
    out = []
    for rank in range(world):
        lines = (log_dir / f"rank{rank}.txt").read_text().splitlines()
        out.append(
            {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
        )
    return out


@pytest.mark.distributed
def test_main_process_first_orders_the_bodies(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    world, _, log_dir = dist_results
    stamps = _stamps(log_dir, world)
    main_end = stamps[0]["main-first body end"]
    last_end = max(s["main-first body end"] for s in stamps)
    for rank in range(1, world):
        assert stamps[rank]["main-first body start"] >= main_end
    for rank in range(world):  # everyone leaves after every body ended
        assert stamps[rank]["main-first left"] >= last_end


@pytest.mark.distributed
def test_local_main_process_first_orders_each_machine(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    world, _, log_dir = dist_results
    stamps = _stamps(log_dir, world)
    firsts = [r for r in range(world) if r % 2 == 0]
    first_end = max(stamps[r]["local-first body end"] for r in firsts)
    last_end = max(s["local-first body end"] for s in stamps)
    for rank in range(world):
        if rank % 2 == 1:
            assert stamps[rank]["local-first body start"] >= first_end
        assert stamps[rank]["local-first left"] >= last_end


@pytest.mark.distributed
def test_a_body_that_raises_stops_every_rank_without_a_hang(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    world, per_rank, _ = dist_results
    for rank, result in enumerate(per_rank):
        (kind, msg), ran = result["main fails"]
        if rank == 0:
            assert (kind, msg, ran) == ("ValueError", "main failed", [0])
        else:
            assert kind == "RuntimeError" and ran == []
            assert msg.startswith(
                "main_process_first: the body raised (while the first processes ran "
                "it) on rank(s) [0]; this rank stops too."
            )
        kind, msg = result["other fails"]
        if rank == 1:
            assert (kind, msg) == ("KeyError", "'rank 1 failed'")
        else:
            assert kind == "RuntimeError"
            assert msg.startswith("main_process_first: the body raised (")
            assert "on rank(s) [1]; this rank stops too." in msg


@pytest.mark.distributed
def test_print_main_on_real_ranks(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    _, per_rank, _ = dist_results
    assert [r["printed"] for r in per_rank] == ["hello 0\n"] + [""] * (
        len(per_rank) - 1
    )


@pytest.mark.distributed
def test_get_logger_writes_in_rank_order(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    world, _, log_dir = dist_results
    lines = (log_dir / "shared.log").read_text().splitlines()
    assert lines == (
        ["default from 0"]
        + [f"ordered from {r}" for r in range(world)]
        + [f"ordered again from {r}" for r in range(world) if r != 1]
        + [f"mark {r}" for r in range(world)]
    )
