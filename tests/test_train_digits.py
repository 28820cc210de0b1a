"""The main example, run as a user runs it: one process, torchrun, stop and resume.

Besides the results, a run shows what a person watching it needs: progress on
stderr (plain lines when, as here, stderr is not a terminal) and one summary line
per epoch, from the main process only; then where the metrics went, the command
to view them and the loss-curve picture drawn at the end.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from tests._scripts import REPO
from tests._scripts import Finished
from tests._scripts import run_script

pytest.importorskip("sklearn")

SCRIPT = REPO / "examples" / "train_digits.py"
TINY = ["--epochs", "2", "--train-samples", "320", "--batch-size", "16"]


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EPOCH_LINE = r"^epoch (\d+)/(\d+): loss (\d+\.\d{4}), lr (\S+), (\d+) samples/s$"


def _finished(args: list[str], *, processes: int = 1, timeout: float = 240) -> Finished:
    done = run_script(
        SCRIPT,
        *args,
        processes=processes,
        timeout=timeout,
    )
    assert done.status == 0, done.stdout + done.stderr
    return done


def _run(args: list[str], *, processes: int = 1, timeout: float = 240) -> str:
    return _finished(args, processes=processes, timeout=timeout).stdout


def _value(out: str, key: str) -> str:
    found: list[str] = re.findall(rf"^{key}: (\S+)$", out, flags=re.MULTILINE)
    assert len(found) == 1, out
    return found[0]


def _after(out: str, prefix: str) -> str:
    """The word after ``prefix`` on the one line that starts with it."""
    found: list[str] = re.findall(
        rf"^{re.escape(prefix)} (\S+)", out, flags=re.MULTILINE
    )
    assert len(found) == 1, out
    return found[0]


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def _assert_shows_the_run(done: Finished, run_dir: Path) -> None:
    """One summary line per epoch, progress, and where everything went: once each."""
    out = done.stdout
    epochs = re.findall(EPOCH_LINE, out, flags=re.MULTILINE)
    assert [(e, total) for e, total, *_ in epochs] == [("1", "2"), ("2", "2")], out
    for _, _, loss, lr, rate in epochs:
        assert 0 < float(loss) < 10 and 0 < float(lr) <= 1e-2 and int(rate) > 0
    # The progress display: plain lines on stderr, which is not a terminal here,
    # ending each epoch at 20/20 (1 process) or 10/10 (2), from rank 0 only.
    ends = re.findall(r"^epoch (\d)/2: (\d+)/\2 \(100%\)", done.stderr, re.MULTILINE)
    assert [epoch for epoch, _ in ends] == ["1", "2"], done.stderr
    assert "\r" not in done.stderr
    assert _after(out, "metrics written to") == str(run_dir / "metrics.jsonl")
    if importlib.util.find_spec("tensorboard") is not None:
        assert _after(out, "view with: tensorboard --logdir") == str(
            run_dir / "tensorboard"
        )
        assert any((run_dir / "tensorboard").iterdir())
    picture = Path(_after(out, "loss curve:"))
    assert picture == run_dir / "metrics.png"
    data = picture.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert _after(out, "checkpoints:") == "none"


def test_one_process_run_prints_accuracy_and_digest_last(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = _finished([*TINY, "--run-dir", str(tmp_path / "logs")])
    out = done.stdout
    _assert_shows_the_run(done, tmp_path / "logs")
    assert re.fullmatch(r"param_sha256: [0-9a-f]{64}", _last_line(out))
    assert 0.0 <= float(_value(out, "test_accuracy")) <= 1.0
    # 320 samples in batches of 16 = 20 micro-batches per epoch, windows of 2.
    assert int(_value(out, "optimizer_steps")) == 2 * 10
    records = [
        json.loads(line)
        for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert "config" in records[0]
    steps = [r["step"] for r in records[1:] if "loss" in r]
    assert steps == list(range(1, 21))
    assert all(0 < r["lr"] <= 1e-2 for r in records[1:] if "loss" in r)
    per_epoch = [r for r in records if "epoch_loss" in r]
    assert [r["step"] for r in per_epoch] == [10, 20]
    assert all(r["samples_per_s"] > 0 for r in per_epoch)
    assert records[-1]["test_accuracy"] == pytest.approx(
        float(_value(out, "test_accuracy")), abs=1e-4
    )


def test_same_seed_and_a_stopped_and_resumed_run_end_bit_for_bit_alike(
    tmp_path: Path,
) -> None:
    # The first run logs to the default run directory, a new runs/digits-<time>
    # under the current directory (the checkout here), removed afterwards; it
    # writes no checkpoints.
    first = _run(TINY)
    written = Path(_after(first, "metrics written to"))
    assert re.fullmatch(r"runs/digits-\d{8}-\d{6}(-\d+)?/metrics\.jsonl", str(written))
    assert (REPO / written).is_file()
    shutil.rmtree(REPO / written.parent)
    # The same seed, stopped after 13 optimizer steps and resumed, ends with the
    # parameters of the uninterrupted first run.
    logs = ["--run-dir", str(tmp_path / "logs")]
    cut = ["--checkpoint-dir", str(tmp_path / "cut")]
    stopped = _run([*TINY, *logs, *cut, "--stop-after", "13"])
    assert "stopped after 13 optimizer steps" in stopped
    assert _after(stopped, "checkpoints:").startswith(str(tmp_path / "cut"))
    assert len(re.findall(EPOCH_LINE, stopped, flags=re.MULTILINE)) == 1
    resumed = _run([*TINY, *logs, *cut])
    assert "resumed from" in resumed
    assert _value(resumed, "param_sha256") == _value(first, "param_sha256")
    assert _value(resumed, "optimizer_steps") == _value(first, "optimizer_steps")
    # Another seed gives other parameters.
    other = _run([*TINY, "--seed", "1", "--run-dir", str(tmp_path / "other")])
    assert _value(other, "param_sha256") != _value(first, "param_sha256")


@pytest.mark.distributed
def test_two_processes_under_torchrun_with_profiling_and_bf16(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = _finished(
        [
            *TINY,
            "--bf16",
            "--log-dir",  # the older name of --run-dir
            str(tmp_path / "logs"),
            "--profile-dir",
            str(tmp_path / "traces"),
        ],
        processes=2,
    )
    out = done.stdout
    _assert_shows_the_run(done, tmp_path / "logs")
    assert re.fullmatch(r"param_sha256: [0-9a-f]{64}", _last_line(out))
    # Each rank reads 10 of the 20 batches per epoch: 5 windows of 2 per epoch.
    assert int(_value(out, "optimizer_steps")) == 2 * 5
    for rank in (0, 1):
        trace = json.loads((tmp_path / "traces" / f"profile_{rank}.json").read_text())
        assert trace["traceEvents"]
    metrics = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    # config, one line per step, one per epoch, test accuracy
    assert len(metrics) == 1 + 10 + 2 + 1


@pytest.mark.slow
def test_the_default_run_reaches_95_percent_test_accuracy(tmp_path: Path) -> None:
    out = _run(["--run-dir", str(tmp_path / "logs")], timeout=300)
    assert float(_value(out, "test_accuracy")) >= 0.95
