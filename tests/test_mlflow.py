"""Tests for MLflowTracker: gating, values read back from MLflow, and errors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

import pytest
import torch

from funcaccel._checks import summary
from funcaccel.context import DistributedContext
from funcaccel.tracking import MLflowTracker
from funcaccel.tracking import finish_trackers
from funcaccel.tracking import log_metrics
from funcaccel.tracking import store_config
from tests.fixtures import rank_ctx

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

# MLflow's SQLite store configures its SQLAlchemy mappers with a loader strategy
# that SQLAlchemy 2.1 deprecates; pytest turns warnings into errors.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning"
)

SINGLE = DistributedContext()


def _any(value: object) -> Any:
    """Pass a value of the wrong type past mypy, as an untyped caller would."""
    return value


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite store for the module: creating its tables takes seconds."""
    pytest.importorskip("mlflow")
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


def _client(database: Path) -> MlflowClient:
    """A client of its own, so reads go through the database, not the tracker."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{database}")


def test_mlflow_tracker_names_the_extra_when_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install 'funcaccel\[mlflow\]'"):
        MLflowTracker(tmp_path / "mlflow.db")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sqlite:///runs/mlflow.db", "sqlite:///runs/mlflow.db"),
        ("http://localhost:5000", "http://localhost:5000"),
        ("https://mlflow.example.org", "https://mlflow.example.org"),
        ("file:///tmp/mlruns", "file:///tmp/mlruns"),
    ],
)
def test_mlflow_tracker_passes_a_uri_through(given: str, expected: str) -> None:
    pytest.importorskip("mlflow")
    assert MLflowTracker(given).tracking_uri == expected


def test_mlflow_tracker_reads_a_path_as_a_local_database(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    expected = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert MLflowTracker("runs/mlflow.db").tracking_uri == expected
    assert MLflowTracker(Path("runs/mlflow.db")).tracking_uri == expected
    assert MLflowTracker(tmp_path / "runs" / "mlflow.db").tracking_uri == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tracking_uri": 3}, TypeError, r"tracking_uri must be a str .* got 3 \(int"),
        (
            {"tracking_uri": ""},
            ValueError,
            r"tracking_uri must be a database file or a URI; got ''",
        ),
        (
            {"tracking_uri": "x.db", "experiment_name": ""},
            ValueError,
            r"experiment_name must be non-empty; got ''",
        ),
        (
            {"tracking_uri": "x.db", "run_name": 7},
            TypeError,
            r"run_name must be a str; got 7 \(int\)",
        ),
        (
            {"tracking_uri": "x.db", "main_process_only": "yes"},
            TypeError,
            r"main_process_only must be a bool; got 'yes'",
        ),
    ],
)
def test_mlflow_tracker_rejects_bad_arguments(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=rf"MLflowTracker: {match}"):
        MLflowTracker(**_any(kwargs))


def test_mlflow_tracker_logs_metrics_tags_and_params_read_back(
    database: Path,
) -> None:
    tracker = MLflowTracker(database, experiment_name="read-back", run_name="first")
    assert tracker.run_id is None
    store_config(SINGLE, [tracker], {"lr": 0.1, "opt": "adam", "sched": None})
    store_config(SINGLE, [tracker], {"amp": True, "lr": 0.1})  # same value again
    log_metrics(
        SINGLE,
        [tracker],
        {"loss": _any(torch.tensor([0.5])), "acc": 1, "phase": "warmup"},
        step=3,
    )
    log_metrics(SINGLE, [tracker], {"loss": 0.25, "phase": "train"}, step=4)
    log_metrics(SINGLE, [tracker], {"done": True})
    finish_trackers(SINGLE, [tracker])
    finish_trackers(SINGLE, [tracker])  # a second finish is harmless
    run_id = tracker.run_id
    assert run_id is not None

    client = _client(database)
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(3, 0.5), (4, 0.25)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "acc")] == [
        (3, 1.0)
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "done")] == [
        (0, 1.0)
    ]
    run = client.get_run(run_id)
    assert run.data.params == {
        "lr": "0.1",
        "opt": "adam",
        "sched": "None",
        "amp": "True",
    }
    assert run.data.tags["phase"] == "train"  # a tag keeps the latest string
    assert (run.info.run_name, run.info.status) == ("first", "FINISHED")
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "read-back"
    assert experiment.artifact_location == (database.parent / "mlartifacts").as_uri()
    with pytest.raises(ValueError, match="MLflowTracker.log: the tracker was finished"):
        tracker.log({"loss": 1.0})


def test_mlflow_tracker_on_a_non_main_rank_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    database = tmp_path / "runs" / "mlflow.db"
    tracker = MLflowTracker(database)
    store_config(rank_ctx(2, 1), [tracker], {"lr": 0.1})
    log_metrics(rank_ctx(2, 1), [tracker], {"loss": 0.5}, step=3)
    finish_trackers(rank_ctx(2, 1), [tracker])
    assert (tracker.run_id, list(tmp_path.iterdir())) == (None, [])


def test_mlflow_tracker_not_main_process_only_logs_on_every_rank(
    database: Path,
) -> None:
    trackers = {
        rank: MLflowTracker(
            database,
            experiment_name="every-rank",
            run_name=f"rank{rank}",
            main_process_only=False,
        )
        for rank in (0, 1)
    }
    for rank, tracker in trackers.items():
        log_metrics(rank_ctx(2, rank), [tracker], {"loss": float(rank)}, step=1)
        finish_trackers(rank_ctx(2, rank), [tracker])
    client = _client(database)
    for rank, tracker in trackers.items():
        run_id = tracker.run_id
        assert run_id is not None
        history = client.get_metric_history(run_id, "loss")
        assert [(m.step, m.value) for m in history] == [(1, float(rank))]
        assert client.get_run(run_id).info.run_name == f"rank{rank}"
    assert trackers[0].run_id != trackers[1].run_id


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda t: t.log({"loss": torch.ones(2)}),
            ValueError,
            r"MLflowTracker.log: value 'loss' must be one number; got "
            r"tensor\(shape=\(2,\)",
        ),
        (
            lambda t: t.log({"loss": [1.0]}),
            TypeError,
            r"MLflowTracker.log: value 'loss' must be .*; got \[1.0\] \(list\)",
        ),
        (
            lambda t: t.log({1: 1.0}),
            TypeError,
            r"MLflowTracker.log: every key must be a str; got 1 \(int\)",
        ),
        (
            lambda t: t.log({"loss": 1.0}, step=-1),
            ValueError,
            r"MLflowTracker.log: step \(-1\) must be >= 0",
        ),
        (
            lambda t: t.log({"loss": 1.0}, step=1.5),
            TypeError,
            r"MLflowTracker.log: step must be an int or None; got 1.5",
        ),
        (
            lambda t: t.store_init_configuration({"betas": (0.9, 0.99)}),
            TypeError,
            r"MLflowTracker.store_init_configuration: configuration value 'betas'",
        ),
    ],
)
def test_mlflow_tracker_rejects_bad_values_before_writing(
    tmp_path: Path, call: Callable[[Any], object], error: type[Exception], match: str
) -> None:
    pytest.importorskip("mlflow")
    tracker = MLflowTracker(tmp_path / "mlflow.db")
    with pytest.raises(error, match=match):
        call(tracker)
    assert (tracker.run_id, list(tmp_path.iterdir())) == (None, [])


def test_mlflow_tracker_names_a_directory_or_an_unwritable_path(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    with pytest.raises(
        ValueError,
        match=r"MLflowTracker: tracking_uri must be a database file, not a "
        r"directory; got '.*'\. Pass the database file in it",
    ):
        MLflowTracker(tmp_path).log({"loss": 1.0})
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        OSError, match=r"MLflowTracker: cannot create the directory of '.*file/run"
    ):
        MLflowTracker(tmp_path / "file" / "run" / "mlflow.db").log({"loss": 1.0})


def test_mlflow_tracker_explains_values_mlflow_rejects(database: Path) -> None:
    tracker = MLflowTracker(database, experiment_name="rejected")
    with pytest.raises(
        ValueError, match=r"MLflowTracker.log: MLflow rejected a value: .*rename"
    ):
        tracker.log({"loss@train": 1.0})
    tracker.store_init_configuration({"lr": 0.1})
    with pytest.raises(
        ValueError,
        match=r"store_init_configuration: MLflow rejected .* cannot change once",
    ):
        tracker.store_init_configuration({"lr": 0.2})
    tracker.finish()
    run_id = tracker.run_id
    assert run_id is not None
    assert _client(database).get_run(run_id).data.params == {"lr": "0.1"}


def _refuses_file_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip unless this MLflow refuses a file store without the opt-out (MLflow 3)."""
    variables = pytest.importorskip("mlflow.environment_variables")
    if not hasattr(variables, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow accepts a file store without an opt-out")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)


@pytest.mark.parametrize(
    ("call", "owner"),
    [
        (lambda t: t.log({"loss": 1.0}), "log"),
        (lambda t: t.store_init_configuration({"lr": 0.1}), "store_init_configuration"),
    ],
)
def test_mlflow_tracker_names_a_refused_file_store_and_the_opt_out(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    call: Callable[[Any], object],
    owner: str,
) -> None:
    _refuses_file_stores(monkeypatch)
    uri = (tmp_path / "mlruns").as_uri()
    tracker = MLflowTracker(uri)
    with pytest.raises(ValueError) as caught:
        call(tracker)
    assert str(caught.value) == (
        # The URI in its bounded form: a long tmp_path (pytest-xdist's) is cut.
        f"MLflowTracker.{owner}: MLflow refused the tracking backend {summary(uri)} (a file "
        "store, which MLflow 3 opens only on request); set "
        "MLFLOW_ALLOW_FILE_STORE=true in the environment, or pass a database URI "
        "such as 'sqlite:///mlruns.db'."
    )
    assert tracker.run_id is None
    assert list(tmp_path.iterdir()) == []


def test_mlflow_tracker_shows_a_long_refused_uri_in_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _refuses_file_stores(monkeypatch)
    uri = "file:///" + "x" * 1000
    with pytest.raises(
        ValueError, match=r"refused the tracking backend 'file:///x+ \.\.\. x+'"
    ) as caught:
        MLflowTracker(uri).log({"loss": 1.0})
    assert len(str(caught.value)) < 300


def test_mlflow_tracker_uses_a_file_store_with_the_opt_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _refuses_file_stores(monkeypatch)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    tracker = MLflowTracker(uri, experiment_name="file-store")
    tracker.log({"loss": 0.5}, step=2)
    tracker.finish()
    run_id = tracker.run_id
    assert run_id is not None
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(2, 0.5)]


def test_mlflow_tracker_keeps_other_set_up_rejections_as_rejected_values(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    def refuse(**_: object) -> None:
        raise MlflowException("bad name", error_code=INVALID_PARAMETER_VALUE)

    monkeypatch.setattr(mlflow_tracking, "MlflowClient", refuse)
    with pytest.raises(ValueError) as caught:
        MLflowTracker(tmp_path / "mlflow.db").log({"loss": 1.0})
    assert str(caught.value) == (
        "MLflowTracker.log: MLflow rejected a value: bad name; pass an "
        "experiment_name and run_name MLflow accepts, and restore the experiment "
        "'funcaccel' if it was deleted."
    )
