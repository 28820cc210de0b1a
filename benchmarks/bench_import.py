"""How much ``import funcaccel`` adds to ``import torch``.

Runs fresh interpreters, interleaving the commands so that machine noise hits
them alike, and prints the medians of wall time and of CPU time (user + system of
the child, which other processes on the machine disturb less), the spread and the
ratios as Markdown.

The children run with a warm bytecode cache in a temporary folder
(``PYTHONPYCACHEPREFIX``), as an installed package has after its first import
(pip compiles a wheel's modules on install). ``--cold`` runs them without one,
compiling funcaccel from source each time, as with ``PYTHONDONTWRITEBYTECODE=1``.

    python benchmarks/bench_import.py --repeats 15

Wall and CPU time on a shared machine vary by more than funcaccel's whole import.
``--instructions`` counts the instructions each script-imports command executes
under valgrind's callgrind instead (one run each, a fixed hash seed), which is the
same from run to run whatever else the machine does; it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SCRIPT = "import torch; import torch.distributed; import torch.utils.data"
COMMANDS = {
    "import torch": "import torch",
    "import torch, funcaccel": "import torch; import funcaccel",
    # What a training script imports anyway, with and without funcaccel; the
    # control runs the first command again, so its ratio shows the noise.
    "script imports": _SCRIPT,
    "script imports, funcaccel": f"{_SCRIPT}; import funcaccel",
    "script imports (noise control)": _SCRIPT,
}


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time_once(code: str, env: Mapping[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh interpreter running ``code``."""
    cpu = _child_cpu()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
    return time.perf_counter() - start, _child_cpu() - cpu


def _child_env(cache: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPYCACHEPREFIX", None)
    if cache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = cache
    return env


def _self_time_of_funcaccel(env: Mapping[str, str]) -> float:
    """Seconds ``-X importtime`` attributes to funcaccel's own modules."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import torch; import funcaccel"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    ).stderr
    total_us = 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2].lstrip().startswith("funcaccel"):
            total_us += int(parts[0])
    return total_us / 1e6


_COLLECTED = re.compile(r"^==\d+== Collected : (\d+)$", re.MULTILINE)


def collected_instructions(valgrind_stderr: str) -> int:
    """The instruction count callgrind reports at exit (its ``Collected`` line)."""
    found = _COLLECTED.findall(valgrind_stderr)
    if len(found) != 1:
        msg = f"expected one 'Collected :' line from callgrind, found {len(found)}"
        raise ValueError(msg)
    return int(found[0])


def _instructions(code: str, env: Mapping[str, str], out_dir: str) -> int:
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out_dir}/callgrind.out.%p",
            sys.executable,
            "-c",
            code,
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONHASHSEED": "0"},
    )
    return collected_instructions(done.stderr)


def _report_instructions(env: Mapping[str, str], out_dir: str) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("bench_import: --instructions needs valgrind on PATH")
    _time_once(COMMANDS["script imports, funcaccel"], env)  # write the bytecode cache
    names = [
        "script imports",
        "script imports, funcaccel",
        "script imports (noise control)",
    ]
    counts = {name: _instructions(COMMANDS[name], env, out_dir) for name in names}
    base = counts["script imports"]
    print("| command | instructions | ratio |")
    print("|---|---|---|")
    for name, count in counts.items():
        print(f"| `{name}` | {count} | {count / base:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15, help="1 or more")
    parser.add_argument(
        "--cold", action="store_true", help="no bytecode cache: compile each time"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions under callgrind instead of timing (needs valgrind)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    with tempfile.TemporaryDirectory(prefix="funcaccel-pycache-") as cache:
        env = _child_env(None if args.cold else cache)
        if args.instructions:
            _report_instructions(env, cache)
        else:
            _report(args.repeats, env)


def _report(repeats: int, env: Mapping[str, str]) -> None:
    walls: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpus: dict[str, list[float]] = {name: [] for name in COMMANDS}
    # One untimed run warms the file cache and writes funcaccel's bytecode cache.
    _time_once(COMMANDS["script imports, funcaccel"], env)
    for _ in range(repeats):
        for name, code in COMMANDS.items():
            wall, cpu = _time_once(code, env)
            walls[name].append(wall)
            cpus[name].append(cpu)
    print(
        "| command | wall median s | wall IQR s | CPU median s | CPU IQR s "
        "| wall ratio | CPU ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in COMMANDS:
        # The script rows compare with the script's own imports, the others with torch.
        base = "script imports" if name.startswith("script") else "import torch"
        cells = []
        for seconds in (walls[name], cpus[name]):
            q1, _, q3 = statistics.quantiles(seconds, n=4) if repeats > 1 else (0, 0, 0)
            cells += [f"{statistics.median(seconds):.3f}", f"{q3 - q1:.3f}"]
        for table in (walls, cpus):
            ratio = statistics.median(table[name]) / statistics.median(table[base])
            cells.append(f"{ratio:.3f}")
        print(f"| `{name}` | {' | '.join(cells)} |")
    extra = statistics.median(walls["import torch, funcaccel"]) - statistics.median(
        walls["import torch"]
    )
    print(f"\nfuncaccel adds {extra * 1000:.0f} ms of wall time (median difference);")
    for label, table in (("wall", walls), ("CPU", cpus)):
        script = statistics.median(table["script imports"])
        with_fa = statistics.median(table["script imports, funcaccel"]) / script
        control = statistics.median(table["script imports (noise control)"]) / script
        print(
            f"{label}: over a script's own imports {with_fa:.3f}x "
            f"(noise control {control:.3f}x);"
        )
    print(
        "-X importtime self time of funcaccel modules: "
        f"{_self_time_of_funcaccel(env) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
