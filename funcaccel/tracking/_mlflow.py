"""The MLflow tracker, which imports mlflow only when first used.

Install it with ``pip install 'funcaccel[mlflow]'`` and import it from
``funcaccel.tracking`` (or ``funcaccel``). The tracker talks to one
``mlflow.MlflowClient`` of its own and never touches MLflow's process-wide state
(``mlflow.set_tracking_uri``, the active run), so several trackers, pointing at
different stores, may live in one process.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Final

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import summary
from funcaccel.tracking._base import PlainMetrics
from funcaccel.tracking._base import TrackerBase
from funcaccel.tracking._base import check_name
from funcaccel.tracking._base import require_package
from funcaccel.tracking._values import ConfigValue

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

__all__ = ["MLflowTracker"]

# A scheme of two or more characters ("sqlite:", "http:", "databricks:"), so that a
# Windows drive letter ("C:\\runs\\mlflow.db") reads as a path.
_URI_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]+:")

# MLflow takes at most 100 params and 100 tags per log_batch request (and 1000
# entities in all), so each request carries at most this many of each kind.
_BATCH: Final = 100


def _tracking_uri(value: object) -> tuple[str, Path | None]:
    """Return the tracking URI and, for a local database, the database file."""
    hint = (
        "Pass a path such as 'runs/mlflow.db' or a URI such as 'http://localhost:5000'."
    )
    what = "a str or os.PathLike"
    value = check_type(
        "MLflowTracker", "tracking_uri", value, (str, os.PathLike), what=what, hint=hint
    )
    if isinstance(value, str) and _URI_SCHEME.match(value):
        return value, None
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        fail_value("MLflowTracker", "tracking_uri", value, *_DATABASE)
    database = Path(os.path.abspath(text))
    return f"sqlite:///{database.as_posix()}", database


_DATABASE: Final = ("a database file or a URI", "Pass a path such as 'runs/mlflow.db'.")
_NOT_DIR: Final = "a database file, not a directory"
_NAMES_HINT: Final = (
    "MLflow names hold only letters, digits, '_', '-', '.', ' ', ':' and '/'"
)


@contextmanager
def _explained(owner: str, hint: str) -> Iterator[None]:
    """Re-raise a value MLflow rejects as a ``ValueError`` that names ``owner``."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as error:
        if error.error_code != "INVALID_PARAMETER_VALUE":
            raise
        msg = f"{owner}: MLflow rejected a value: {error.message}; {hint}."
        raise ValueError(msg) from error


# MLflow 3 refuses a file store ("file:..." URIs) with an INVALID_PARAMETER_VALUE
# that names this opt-out; nothing else in the error tells it from a bad name.
_FILE_STORE_OPT_OUT: Final = "MLFLOW_ALLOW_FILE_STORE"


@contextmanager
def _refused_file_store(owner: str, uri: str) -> Iterator[None]:
    """Re-raise MLflow's refusal of a file store as a ``ValueError`` naming ``uri``."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as error:
        if (
            error.error_code != "INVALID_PARAMETER_VALUE"
            or _FILE_STORE_OPT_OUT not in error.message
        ):
            raise
        msg = (
            f"{owner}: MLflow refused the tracking backend {summary(uri)} (a file "
            "store, which MLflow 3 opens only on request); set "
            f"{_FILE_STORE_OPT_OUT}=true in the environment, or pass a database "
            "URI such as 'sqlite:///mlruns.db'."
        )
        raise ValueError(msg) from error


def _prepare_database(database: Path) -> None:
    """Create the database's directory, or say why it cannot be a database."""
    # MLflow retries a database it cannot open for about two minutes before it
    # raises, so the common mistakes are caught here first.
    if database.is_dir():
        hint = f"Pass the database file in it, such as {str(database / 'mlflow.db')!r}."
        fail_value("MLflowTracker", "tracking_uri", str(database), _NOT_DIR, hint)
    try:
        database.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        msg = (
            f"MLflowTracker: cannot create the directory of {str(database)!r}: "
            f"{error}; pass a path in a directory this process can write."
        )
        raise OSError(msg) from error


def _experiment_id(
    client: MlflowClient, name: str, artifact_location: str | None
) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        found: str = experiment.experiment_id
        return found
    try:
        created: str = client.create_experiment(
            name, artifact_location=artifact_location
        )
        return created
    except MlflowException as error:
        # Another rank (main_process_only=False) created it in the meantime.
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None, name
    existing: str = experiment.experiment_id
    return existing


class MLflowTracker(TrackerBase):
    """Record metrics, tags and params in an MLflow run, through ``MlflowClient``.

    ``tracking_uri`` is either a path or a URI. A path (``"runs/mlflow.db"``, the
    local default) names a SQLite database, made absolute on construction and
    created with its directory on first use; a new experiment in it keeps its
    artifacts in ``mlartifacts/`` beside the database rather than under the
    working directory. A string that starts with a scheme (``"sqlite:///..."``,
    ``"http://host:5000"``, ``"https://..."``, ``"file:..."``, ``"databricks:..."``)
    is passed to MLflow as is.

    The experiment (created when missing) and a new run are set up on the first
    call. ``log`` writes numbers (and bools, as 0/1) as metrics at ``step``
    (``step=None`` is step 0, as in MLflow); strings become run tags, which keep
    only the latest value (use ``JSONLTracker`` for a history of strings).
    ``store_init_configuration`` writes params as strings (``None`` as ``"None"``);
    MLflow keeps a param fixed once stored, so storing a key again with another
    value is a ``ValueError``. Every request waits until MLflow has stored it, so
    ``finish()`` only marks the run ``FINISHED``.

    With ``main_process_only=False`` each process makes a run of its own in the
    experiment; give each rank its own ``run_name`` to tell them apart.

    Args:
        tracking_uri: the local database file, or an MLflow tracking URI.
        experiment_name: the experiment the run is recorded in.
        run_name: the run's name; MLflow picks one when ``None``.
        main_process_only: whether only the main process writes (the default).

    Raises:
        ImportError: mlflow is not installed (checked on construction, so every
            rank fails early; nothing is imported until the first call).
        ValueError: on the first call, when MLflow refuses a file store
            (``"file:..."``): MLflow 3 opens one only when the environment sets
            ``MLFLOW_ALLOW_FILE_STORE=true``; a path or a database URI needs no
            opt-out.
    """

    __slots__ = (
        "_artifact_location",
        "_client",
        "_database",
        "_experiment_name",
        "_run_id",
        "_run_name",
        "_tracking_uri",
    )

    def __init__(
        self,
        tracking_uri: str | os.PathLike[str],
        *,
        experiment_name: str = "funcaccel",
        run_name: str | None = None,
        main_process_only: bool = True,
    ) -> None:
        uri, database = _tracking_uri(tracking_uri)
        check_name("MLflowTracker", "experiment_name", experiment_name, "funcaccel")
        if run_name is not None:
            check_name("MLflowTracker", "run_name", run_name, "funcaccel")
        super().__init__(name="mlflow", main_process_only=main_process_only)
        require_package("MLflowTracker", "mlflow", "mlflow")
        self._tracking_uri = uri
        self._database = database
        self._artifact_location = (
            None if database is None else (database.parent / "mlartifacts").as_uri()
        )
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._client: MlflowClient | None = None
        self._run_id: str | None = None

    @property
    def tracking_uri(self) -> str:
        """The URI passed to ``MlflowClient`` (``sqlite:///...`` for a path)."""
        return self._tracking_uri

    @property
    def experiment_name(self) -> str:
        """The experiment the run is recorded in."""
        return self._experiment_name

    @property
    def run_name(self) -> str | None:
        """The run name given on construction, or ``None``."""
        return self._run_name

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id, or ``None`` before the first call."""
        return self._run_id

    def _ready_run(self, method: str) -> tuple[MlflowClient, str]:
        if self._client is not None and self._run_id is not None:
            return self._client, self._run_id
        from mlflow.tracking import MlflowClient

        if self._database is not None:
            _prepare_database(self._database)
        hint = (
            f"pass an experiment_name and run_name MLflow accepts, and restore the "
            f"experiment {self._experiment_name!r} if it was deleted"
        )
        owner = f"MLflowTracker.{method}"
        # The refusal is turned into a ValueError first, so _explained, which
        # handles only MLflow's errors, leaves it as it is.
        with (
            _explained(owner, hint),
            _refused_file_store(owner, self._tracking_uri),
        ):
            client = MlflowClient(tracking_uri=self._tracking_uri)
            experiment_id = _experiment_id(
                client, self._experiment_name, self._artifact_location
            )
            run = client.create_run(experiment_id, run_name=self._run_name)
        self._client, self._run_id = client, run.info.run_id
        return client, run.info.run_id

    def _write_metrics(self, values: PlainMetrics, step: int | None) -> None:
        """Write numbers as metrics at ``step`` and strings as run tags."""
        from mlflow.entities import Metric
        from mlflow.entities import RunTag

        client, run_id = self._ready_run("log")
        millis = int(time.time() * 1000)
        at = 0 if step is None else step
        metrics = [
            Metric(key, float(value), millis, at)
            for key, value in values.items()
            if not isinstance(value, str)
        ]
        tags = [
            RunTag(key, value)
            for key, value in values.items()
            if isinstance(value, str)
        ]
        with _explained("MLflowTracker.log", f"rename the key ({_NAMES_HINT})"):
            for start in range(0, max(len(metrics), len(tags)), _BATCH):
                client.log_batch(
                    run_id,
                    metrics=metrics[start : start + _BATCH],
                    tags=tags[start : start + _BATCH],
                    synchronous=True,
                )

    def _write_config(self, values: dict[str, ConfigValue]) -> None:
        """Write ``values`` as the run's params, as strings (``None`` as "None")."""
        from mlflow.entities import Param

        owner = "MLflowTracker.store_init_configuration"
        client, run_id = self._ready_run("store_init_configuration")
        params: Sequence[Param] = [
            Param(key, str(value)) for key, value in values.items()
        ]
        hint = (
            "a param cannot change once stored in a run: store each key once, or "
            f"log a changing value as a metric ({_NAMES_HINT})"
        )
        with _explained(owner, hint):
            for start in range(0, len(params), _BATCH):
                client.log_batch(
                    run_id, params=params[start : start + _BATCH], synchronous=True
                )

    def _close(self) -> None:
        """Mark the run ``FINISHED`` (if it was ever created)."""
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id)
            self._client = None
