"""MLflow: one run per training job, written by rank 0 through ``MlflowClient`` (no global active run)."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from distrain.artifacts.outputs import check_writable
from distrain.errors import ArtifactError
from distrain.trackers.base import TrackedRun, TrackerSetupError, numeric_metrics, require_package
from distrain.trackers.reporter import strict_json

log = logging.getLogger(__name__)

MLFLOW_ID_FILE = "mlflow_run_id"
REMOTE_SCHEMES = ("http", "https")
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
ALLOWED_URIS = "sqlite:///<path>, http(s)://<host>:<port>, postgresql://..., mysql://..., databricks"
PARAM_VALUE_LIMIT = 6000  # MLflow refuses longer parameter values
BATCH_LIMIT = 100  # parameters per log_batch call
CONNECT_TIMEOUT_S = 3.0
# MLflow retries a failing HTTP call 7 times with backoff and a 120 s timeout: minutes in which rank 0 would hold the
# other ranks at their next collective. A tracker that fails instead is dropped with one warning.
REMOTE_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PER_JOB_KEYS = ("checkpoint.resume", "trainer.max_steps")  # expected to change when a job is continued


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: dotted keys (``optimizer.lr``), values as text within MLflow's limit."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params |= flat_params(value, name + ".")
        else:
            params[name] = str(value)[:PARAM_VALUE_LIMIT]
    return params


class MlflowTracker:
    """Params (the flattened config), metrics per logged step, ``config.yaml`` and ``summary.json`` artifacts.

    By default the store is ``sqlite:///<run dir>/mlflow.db`` with artifacts in ``<run dir>/mlflow-artifacts`` (for
    any sqlite store: ``mlflow-artifacts/`` beside the database file). The run id is kept in
    ``<run dir>/mlflow_run_id``: a job restarted in the same run directory, or resumed from a checkpoint of another
    run logged to the same store, continues that run, unless the run already holds steps after the one resumed
    from (a crash after the last checkpoint): MLflow cannot delete metric points, so the job then opens a new run
    tagged ``distrain.resumed_from_run`` and ``distrain.resumed_at_step``.
    """

    def __init__(
        self, *, tracking_uri: str | None, experiment_name: str, run_name: str | None, tags: dict[str, str]
    ) -> None:
        self.tracking_uri, self.experiment_name = tracking_uri, experiment_name
        self.run_name, self.tags = run_name, tags
        self.client: Any = None
        self.run_id = ""
        self.resumed_from_run: str | None = None  # the run this job could not continue (it logged later steps)

    def absolute_paths(self) -> dict[str, str]:
        return {"tracking_uri": absolute_tracking_uri(self.tracking_uri)} if self.tracking_uri else {}

    def check(self) -> None:
        """The package, and a URI this tracker can reach: a local store's directory exists, a server answers."""
        require_package("mlflow", "mlflow")
        if not self.experiment_name:
            raise TrackerSetupError("experiment_name", self.experiment_name, "a non-empty experiment name")
        uri = self.tracking_uri
        scheme = urlparse(uri).scheme.split("+")[0] if uri else "sqlite"
        if scheme == "sqlite":
            require_package("sqlalchemy", "mlflow")
        if uri is None:
            return
        if scheme in ("", "file"):
            if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
                raise TrackerSetupError(
                    "tracking_uri",
                    uri,
                    "sqlite:///<path> (MLflow 3 opens file stores only with MLFLOW_ALLOW_FILE_STORE=true)",
                )
            _check_store(uri, Path(urlparse(uri).path if scheme else uri), directory=True)
        elif scheme == "sqlite":
            database = sqlite_path(uri)
            if database is None:
                raise TrackerSetupError("tracking_uri", uri, f"{ALLOWED_URIS} (no path after sqlite:///)")
            _check_store(uri, database, directory=False)
        elif scheme in REMOTE_SCHEMES:
            parsed = urlparse(uri)
            _check_reachable(uri, parsed.hostname, parsed.port or (443 if scheme == "https" else 80))
        elif scheme not in DATABASE_SCHEMES and scheme != "databricks":
            raise TrackerSetupError("tracking_uri", uri, ALLOWED_URIS)

    def start(self, run: TrackedRun) -> None:
        for setting, value in REMOTE_LIMITS.items():  # an unreachable server costs seconds per call, not minutes
            os.environ.setdefault(setting, value)
        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow", "alembic"):  # after the import, which sets mlflow's level: no migration notices
            logging.getLogger(noisy).setLevel(logging.WARNING)
        uri = self.tracking_uri or f"sqlite:///{(run.run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        continued = self._continued_run(run)
        self.run_id = continued or self._new_run(run)
        (run.run_dir / MLFLOW_ID_FILE).write_text(self.run_id + "\n")
        self._log_params(flat_params(run.config))
        config_name = f"config_step{run.initial_step}.yaml" if continued else "config.yaml"
        self.client.log_text(self.run_id, yaml.safe_dump(run.config, sort_keys=False), config_name)
        log.info("MLflow run %s in %s", self.run_id, uri)

    def _continued_run(self, run: TrackedRun) -> str | None:
        """The run this job continues: its id is recorded, the store knows it, and it holds no step after
        ``run.initial_step`` (else ``_new_run`` links a new one to it)."""
        run_id = run.recorded_id(MLFLOW_ID_FILE)
        if run_id is None:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MLflow raises its own error for a run id this store does not know
            return None
        logged_steps = [metric.step for metric in self.client.get_metric_history(run_id, "loss")]
        if max(logged_steps, default=0) > run.initial_step:
            self.resumed_from_run = run_id
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _new_run(self, run: TrackedRun) -> str:
        experiment_id = self._experiment_id(run.run_dir)
        tags = dict(self.tags) | ({"group": run.group} if run.group else {})
        if self.resumed_from_run:
            tags |= {"distrain.resumed_from_run": self.resumed_from_run}
            tags |= {"distrain.resumed_at_step": str(run.initial_step)}
        return self.client.create_run(experiment_id, run_name=self.run_name or run.name, tags=tags).info.run_id

    def _experiment_id(self, run_dir: Path) -> str:
        """The experiment's id, created on first use (artifacts beside a sqlite database; a job racing another to
        create it reads the one that won)."""
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        database = sqlite_path(self.tracking_uri) if self.tracking_uri else run_dir / "mlflow.db"
        artifacts = (database.resolve().parent / "mlflow-artifacts").as_uri() if database else None
        try:
            return self.client.create_experiment(self.experiment_name, artifact_location=artifacts)
        except Exception:  # noqa: BLE001 - another job created it between our lookup and our create
            experiment = self.client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _log_params(self, params: dict[str, str]) -> None:
        """Log the params not logged yet; a continued run keeps its first values (MLflow forbids changing them)."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v and k not in PER_JOB_KEYS)
        if changed:
            log.warning("MLflow run keeps its first values of %s (this job's are in its config artifact)", changed)
        fresh = [Param(key, value) for key, value in params.items() if key not in logged]
        for start in range(0, len(fresh), BATCH_LIMIT):
            self.client.log_batch(self.run_id, params=fresh[start : start + BATCH_LIMIT])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, record["step"]) for key, value in numeric_metrics(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict[str, Any]) -> None:
        try:
            self.client.log_text(self.run_id, strict_json(summary, indent=2), "summary.json")
        finally:
            self.client.set_terminated(self.run_id, status="KILLED" if summary.get("stopped_by") else "FINISHED")

    def fail(self) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status="FAILED")


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///<path>`` URI (relative after three slashes, absolute after four)."""
    _, separator, path = uri.partition(":///")
    return Path(path) if separator and path else None


def absolute_tracking_uri(uri: str | None) -> str | None:
    """A relative local store (``sqlite:///m.db``, ``mlruns``) made absolute from this directory, so a requeued
    job started elsewhere, or ``mlflow ui`` given the saved config, finds the same store."""
    if not uri:
        return uri
    scheme = urlparse(uri).scheme
    if scheme.startswith("sqlite") and (database := sqlite_path(uri)) and not database.is_absolute():
        return f"{uri.partition(':///')[0]}:///{database.resolve()}"
    if scheme == "" and not Path(uri).is_absolute():
        return str(Path(uri).resolve())
    return uri


def _check_store(uri: str, path: Path, *, directory: bool) -> None:
    """A local store MLflow can open: a database file (or a file store's directory) it can create or write; the
    path of the other kind would make MLflow retry its connection for minutes."""
    try:
        check_writable(path, directory=directory)
        if not directory and path.is_file() and path.stat().st_size:
            with open(path, "rb") as file:
                if file.read(16) != SQLITE_HEADER:
                    raise ArtifactError(str(path), "not an SQLite database (MLflow's store is one)")
    except ArtifactError as err:
        raise TrackerSetupError("tracking_uri", uri, f"a writable local store ({err})") from None


def _check_reachable(uri: str, host: str | None, port: int) -> None:
    """A TCP connection to the tracking server, so a wrong host or port is refused now, not after MLflow's retries."""
    if not host:
        raise TrackerSetupError("tracking_uri", uri, f"{ALLOWED_URIS} (no host)")
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise TrackerSetupError("tracking_uri", uri, f"a reachable tracking server ({err.strerror or err})") from None
