"""How much ``import funcaccel`` adds to ``import torch``.

Runs fresh interpreters, interleaving the two commands so that machine noise hits
both alike, and prints the medians, the spread and the difference as Markdown.

    python benchmarks/bench_import.py --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
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


def _time_once(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return time.perf_counter() - start


def _self_time_of_funcaccel() -> float:
    """Seconds ``-X importtime`` attributes to funcaccel's own modules."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import torch; import funcaccel"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stderr
    total_us = 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2].lstrip().startswith("funcaccel"):
            total_us += int(parts[0])
    return total_us / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for code in COMMANDS.values():
        _time_once(code)  # warm the file cache
    for _ in range(args.repeats):
        for name, code in COMMANDS.items():
            samples[name].append(_time_once(code))
    base = statistics.median(samples["import torch"])
    print("| command | median s | spread (IQR) s | ratio |")
    print("|---|---|---|---|")
    for name, values in samples.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        median = statistics.median(values)
        print(f"| `{name}` | {median:.3f} | {q3 - q1:.3f} | {median / base:.3f} |")
    extra = statistics.median(samples["import torch, funcaccel"]) - base
    print(f"\nfuncaccel adds {extra * 1000:.0f} ms (median difference);")
    script = statistics.median(samples["script imports"])
    with_fa = statistics.median(samples["script imports, funcaccel"]) / script
    control = statistics.median(samples["script imports (noise control)"]) / script
    print(
        f"over a script's own imports: {with_fa:.3f}x (noise control {control:.3f}x);"
    )
    print(
        f"-X importtime self time of funcaccel modules: {_self_time_of_funcaccel() * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
