"""Count failed exits of the two-process example, run again and again.

Runs ``examples/train_digits.py`` (tiny size, bf16 autocast, the profiler on) under
``torchrun --standalone --nproc_per_node 2`` and/or through ``funcaccel.launch``
(``--modes``), ``--runs`` times each, and counts
the runs whose exit status is not 0. A run that trained to the end and then died
at interpreter exit counts as failed, as it does for a user's job. With
``--busy N``, N processes spin on the CPU meanwhile (a loaded machine makes exit
races likelier). The last lines give the counts and, for each failed run, its exit
status and the last lines of its stderr.

    python benchmarks/stress_exit.py --runs 50 --busy 2
    python benchmarks/stress_exit.py --runs 50 --modes torchrun launch
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_digits.py"
TINY = ["--epochs", "2", "--train-samples", "320", "--batch-size", "16", "--bf16"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Under launch: the example's main() on 2 ranks, started by a fresh interpreter.
LAUNCH_SNIPPET = """
import sys
sys.path.insert(0, {examples!r})
import train_digits
from funcaccel import launch

if __name__ == "__main__":
    launch(train_digits.main, sys.argv[1:], num_processes=2, timeout_s=300)
    print("launch returned")
"""


@dataclass(frozen=True)
class Outcome:
    """One run: how it was started, its exit status and its stderr's tail."""

    mode: str
    status: int
    tail: str
    seconds: float


def _spin() -> None:
    while True:
        pass


@contextmanager
def _busy(n: int) -> Iterator[None]:
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), env.get("PYTHONPATH")])
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_once(mode: str, workdir: Path, timeout: float) -> Outcome:
    args = [*TINY, "--run-dir", str(workdir / "run"), "--profile-dir"]
    args.append(str(workdir / "traces"))
    if mode == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node=2", str(EXAMPLE), *args]
    else:
        snippet = LAUNCH_SNIPPET.format(examples=str(EXAMPLE.parent))
        script = workdir / "launch_digits.py"
        script.write_text(snippet)
        command = [sys.executable, str(script), *args]
    start = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=workdir,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else ""
        return Outcome(mode, -999, "timed out\n" + stderr[-800:], timeout)
    seconds = time.monotonic() - start
    tail = "\n".join(done.stderr.splitlines()[-6:])
    return Outcome(mode, done.returncode, tail, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per mode")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes")
    parser.add_argument(
        "--modes", nargs="+", choices=["torchrun", "launch"], default=["torchrun"]
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="s per run")
    args = parser.parse_args(argv)
    modes: list[str] = args.modes
    outcomes: list[Outcome] = []
    with _busy(args.busy), tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for mode in modes:
                workdir = Path(tmp) / f"{mode}-{i}"
                workdir.mkdir()
                outcome = _run_once(mode, workdir, args.timeout)
                outcomes.append(outcome)
                mark = "ok" if outcome.status == 0 else f"FAILED ({outcome.status})"
                print(
                    f"{mode} run {i + 1}/{args.runs}: {mark} {outcome.seconds:.1f} s",
                    flush=True,
                )
    print()
    for mode in modes:
        mine = [o for o in outcomes if o.mode == mode]
        failed = [o for o in mine if o.status != 0]
        print(
            f"{mode}: {len(failed)} non-zero exits in {len(mine)} runs (busy={args.busy})"
        )
        for o in failed:
            print(f"  exit {o.status}:\n    " + o.tail.replace("\n", "\n    "))
    return 1 if any(o.status != 0 for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
