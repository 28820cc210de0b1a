"""Each benchmark script runs at a tiny size and prints the tables it compares.

Timings are never asserted: each script must finish, print every row of its tables
with numbers in every cell (the reference row's ratios exactly 1), noise-control
rows included, and the training benchmarks must confirm that the plain PyTorch loop
and the funcaccel loop ended with identical parameters.
"""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType
from typing import Final

import pytest

from tests._scripts import REPO
from tests._scripts import run_script

BENCHMARKS = REPO / "benchmarks"
# A table cell the scripts print: a number, a ratio ("0.987×"), a range ("1.2 – 3.4").
_NUMBER: Final = r"-?\d+\.\d+"
_CELL: Final = re.compile(rf"{_NUMBER}×?(?: – {_NUMBER})?")


def _run(name: str, *args: object) -> str:
    done = run_script(BENCHMARKS / f"{name}.py", *args, timeout=300)
    assert done.status == 0, f"{done.command} exited {done.status}:\n{done.stderr}"
    return done.stdout


def _numeric_rows(out: str) -> list[tuple[str, list[str]]]:
    """The Markdown table rows of ``out`` whose cells after the first are all numbers.

    Header and separator rows have none, so they are left out.
    """
    rows = []
    for line in out.splitlines():
        if not (line.startswith("| ") and line.endswith(" |")):
            continue
        name, *cells = (cell.strip() for cell in line[2:-2].split(" | "))
        if cells and all(_CELL.fullmatch(cell) for cell in cells):
            rows.append((name, cells))
    return rows


def _check_rows(
    out: str, names: list[str], width: int, reference: dict[str, list[str]]
) -> None:
    """Assert the numeric rows of ``out`` are ``names`` in order.

    Each row has ``width`` numeric cells after its name, and each row named in
    ``reference`` ends with the cells given there.
    """
    rows = _numeric_rows(out)
    assert [name for name, _ in rows] == names, out
    for name, cells in rows:
        assert len(cells) == width, (name, cells)
        if name in reference:
            tail = reference[name]
            assert cells[-len(tail) :] == tail, (name, cells)


LOOP_ROWS = ["plain PyTorch", "plain PyTorch again (noise control)", "funcaccel"]
ONE_RATIO = ["1.000×"] * 3  # ratio of medians, median paired ratio, ratio of minima


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_bench_loop_runs_and_both_loops_end_equal(precision: str) -> None:
    out = _run(
        "bench_loop", "--repeats", 2, "--micro-batches", 8, "--no-accelerate",
        "--mixed-precision", precision,
    )  # fmt: skip
    assert f"mixed precision {precision}; identical final parameters: True" in out
    _check_rows(out, LOOP_ROWS, 7, {"plain PyTorch": ONE_RATIO})


def test_bench_loop_on_the_tiny_transformer_ends_equal() -> None:
    out = _run(
        "bench_loop", "--repeats", 2, "--micro-batches", 4, "--batch-size", 2,
        "--no-accelerate", "--model", "transformer",
    )  # fmt: skip
    assert out.startswith("transformer: 4 micro-batches of 2")
    assert "identical final parameters: True" in out
    _check_rows(out, LOOP_ROWS, 7, {"plain PyTorch": ONE_RATIO})


@pytest.mark.distributed
def test_bench_ddp_runs_and_both_loops_end_equal() -> None:
    out = _run(
        "bench_ddp", "--repeats", 2, "--warmup", 1, "--micro-batches", 8,
        "--hidden", 16, "--no-pin",
    )  # fmt: skip
    assert "equal final parameters: True" in out
    ddp_rows = ["plain PyTorch DDP", "plain PyTorch DDP again (noise control)"]
    # The wall-time table, then the CPU-time table, with the same rows.
    _check_rows(out, [*ddp_rows, "funcaccel"] * 2, 7, {"plain PyTorch DDP": ONE_RATIO})
    assert out.index("Wall time of an epoch") < out.index("CPU time of the training")


def test_bench_loader_runs() -> None:
    out = _run("bench_loader", "--repeats", 2, "--samples", 256)
    epoch = [
        f"{what}, {order}"
        for order in ("sequential", "shuffled")
        for what in (
            "plain DataLoader",
            "plain DataLoader again (noise control)",
            "`for b in shard_loader(...)`",
            "`iter_batches(loader)`",
        )
    ]
    resume = [f"`iter_batches` from {p} %" for p in (0, 50, 90)]
    resume += [f"skip by reading, {p} % (reference)" for p in (0, 50, 90)]
    one = ["1.000×", "1.000 – 1.000"]  # the median paired ratio and its IQR
    references = {
        "plain DataLoader, sequential": one,
        "plain DataLoader, shuffled": one,
        "`iter_batches` from 0 %": one,
    }
    _check_rows(out, epoch + resume, 5, references)
    assert out.index("## One epoch: 256 samples") < out.index("## Resume")


def test_bench_stream_resume_runs() -> None:
    pytest.importorskip("datasets")
    out = _run("bench_stream_resume", "--repeats", 2, "--samples", 256)
    rows = [f"load the state at {p} %" for p in (10, 50, 90)]
    rows.append("load at 10 % again (noise control)")
    rows += [f"replay to {p} % (the cost it replaces)" for p in (10, 50, 90)]
    one = ["1.000×", "1.000 – 1.000"]  # the median paired ratio and its IQR
    # Two tables: the datasets stream, then the same samples from memory.
    _check_rows(out, rows + rows, 5, {"load the state at 10 %": one})
    assert out.index("## Resume a stream: 256 samples") < out.index("from memory")


def test_bench_import_runs() -> None:
    out = _run("bench_import", "--repeats", 1)
    rows = [
        "`import torch`",
        "`import torch, funcaccel`",
        "`script imports`",
        "`script imports, funcaccel`",
        "`script imports (noise control)`",
    ]
    ones = ["1.000", "1.000"]  # wall and CPU ratios of a reference row
    _check_rows(out, rows, 6, {"`import torch`": ones, "`script imports`": ones})
    assert re.search(
        r"^funcaccel adds -?\d+ ms of wall time \(median difference\);$", out, re.M
    )
    for label in ("wall", "CPU"):
        assert re.search(
            rf"^{label}: over a script's own imports \d+\.\d{{3}}x "
            r"\(noise control \d+\.\d{3}x\);$",
            out,
            re.M,
        ), out
    found = re.search(r"self time of funcaccel modules: (\d+\.\d) ms$", out, re.M)
    # -X importtime attributes time to funcaccel's own modules: parsing found them.
    assert found and float(found[1]) > 0, out


def test_bench_export_runs() -> None:
    out = _run("bench_export", "--repeats", 2, "--hidden", 32, "--layers", 2)
    # The rows of windows without a save have no call time ("-"), so only the
    # saves' rows are all numbers; the windows' rows must be there all the same.
    assert (
        "| a window, no save | " in out
        and "| a window, no save, again (noise control) | " in out
    )
    stall = [
        "synchronous save_checkpoint",
        "synchronous again (noise control)",
        "asynchronous, first save",
        "asynchronous, next save (pending=)",
    ]
    export = [
        "safetensors.torch.save_file",
        "save_file again (noise control)",
        "save_model",
    ]
    durable = [
        "save_file, fsync of file and directory, rename, fsync of parent",
        "the same again (noise control)",
        "save_file + fsync of the file",
        "save_model(..., durable=True)",
    ]
    one = ["1.000×", "1.000×"]  # ratio of medians, median paired ratio
    _check_rows(out, stall + export + durable, 5, {export[0]: one, durable[0]: one})
    rows = dict(_numeric_rows(out))
    assert (
        rows[stall[0]][3] == "1.000×"
    )  # blocked / synchronous, of the synchronous save
    assert (
        out.index("## Training stall")
        < out.index("## Export of the model")
        < out.index("## Durable export")
    )


def _bench_import_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_import", BENCHMARKS / "bench_import.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_import_reads_callgrinds_instruction_count() -> None:
    # --instructions runs valgrind for minutes; its parsing is checked on the
    # lines callgrind prints at exit.
    read = _bench_import_module().collected_instructions
    stderr = (
        "==4242== Callgrind, a call-graph generating cache profiler\n"
        "==4242== Events    : Ir\n"
        "==4242== Collected : 5209952580\n"
        "==4242== \n"
        "==4242== I   refs:      5,209,952,580\n"
    )
    assert read(stderr) == 5209952580
    with pytest.raises(ValueError, match="found 0"):
        read("==1== Events    : Ir\n")
    with pytest.raises(ValueError, match="found 2"):
        read("==1== Collected : 1\n==2== Collected : 2\n")


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_mesh_memory_runs_and_the_meta_model_starts_equal() -> None:
    out = _run(
        "bench_mesh_memory", "--worlds", 2, "--variants", "fsdp_meta",
        "--hidden", 64, "--layers", 1, "--steps", 1,
    )  # fmt: skip
    rows = ["plain PyTorch DDP", "plain PyTorch DDP again (noise control)", "fsdp_meta"]
    _check_rows(out, rows, 8, {})
    cells = dict(_numeric_rows(out))
    assert cells["plain PyTorch DDP"][-2] == "1.000×"  # peak / plain DDP
    losses = {name: row[-1] for name, row in cells.items()}
    # One step: the loss is the initial model's, so meta init gave the same values.
    assert losses["fsdp_meta"] == losses["plain PyTorch DDP"], out
    assert "2 processes" in out


FAST_STEP_ROWS = [
    "plain PyTorch eager",
    "plain PyTorch eager again (noise control)",
    "funcaccel eager",
    "funcaccel compiled blocks (aot_eager)",
    "no checkpointing",
    "full, every block",
    "full, every 2nd block",
    "selective (matrix products kept)",
]


@pytest.mark.slow
def test_bench_fast_step_runs_and_compiled_equals_eager() -> None:
    # The one-process tables, compiled by aot_eager (the distributed tables
    # spawn 6 runs and inductor compiles for seconds: too slow here).
    out = _run(
        "bench_fast_step", "--dim", 16, "--heads", 2, "--blocks", 2, "--seq", 4,
        "--batch", 2, "--k", 2, "--repeats", 1, "--tables", "12",
        "--backend", "aot_eager",
    )  # fmt: skip
    rows = _numeric_rows(out)
    assert [name for name, _ in rows] == FAST_STEP_ROWS, out
    steps = dict(rows[:4])
    assert all(len(cells) == 5 for cells in steps.values())
    assert steps["plain PyTorch eager"][2] == "1.000×"
    # The same final loss (6 decimals) for every variant, the compiled one too.
    assert len({cells[-1] for cells in steps.values()}) == 1, out
    memory = dict(rows[4:])
    assert all(len(cells) == 5 for cells in memory.values())
    assert memory["no checkpointing"][1] == "1.000×"
    assert "0 graph breaks" in out


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_memory_estimate_matches_real_gloo_runs() -> None:
    out = _run(
        "bench_memory_estimate", "--hidden", 64, "--blocks", 2, "--batch-size", 4,
        "--worlds", 4, "--layouts", "ddp", "hsdp", "fsdp_tp",
    )  # fmt: skip
    # Three real 4-rank runs (the full table, FSDP2 at 2 and 4 ranks and the
    # noise-control row included, is in benchmarks/README.md).
    names = ["ddp, 4 ranks", "hsdp, 4 ranks", "fsdp_tp, 4 ranks"]
    _check_rows(out, names, 8, {})
    for name, cells in _numeric_rows(out):
        held_gap, peak_gap = float(cells[2]), float(cells[5])
        # The bounds: held model state within 2 %, the peak within 15 %.
        assert abs(held_gap) <= 2 and abs(peak_gap) <= 15, (name, cells)


PIPELINE_ROWS = [
    "plain PyTorch (one process)",
    "plain PyTorch again (noise control)",
    "1f1b",
    "zbv_zero_bubble",
]


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_pipeline_runs_and_starts_from_the_plain_models_loss() -> None:
    out = _run(
        "bench_pipeline", "--pps", 2, "--schedules", "1f1b,zbv_zero_bubble",
        "--width", 16, "--layers", 4, "--batch", 8, "--microbatches", 4,
        "--steps", 1, "--warmup", 1, "--timeout", 120,
    )  # fmt: skip
    _check_rows(out, PIPELINE_ROWS, 7, {})
    cells = dict(_numeric_rows(out))
    assert cells["plain PyTorch (one process)"][1] == "1.000×"
    # The pipelines' first loss is the whole model's: the same initial values.
    for schedule in ("1f1b", "zbv_zero_bubble"):
        assert float(cells[schedule][-1]) < 1e-5, out
    assert "pp=2 (2 processes)" in out
