"""MLflow: one run per training job, written by rank 0 through ``MlflowClient`` (no global active run)."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from distrain.logger.reporter import strict_json
from distrain.logger.trackers import TrackerSetupError, numeric_metrics, require_package

log = logging.getLogger(__name__)

MLFLOW_ID_FILE = "mlflow_run_id"
REMOTE_SCHEMES = ("http", "https")
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
ALLOWED_URIS = "sqlite:///<path>, file:///<dir>, a directory, http(s)://<host>:<port>, postgresql://..., mysql://..."
PARAM_VALUE_LIMIT = 6000  # MLflow refuses longer parameter values
BATCH_LIMIT = 100  # parameters per log_batch call
CONNECT_TIMEOUT_S = 3.0


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

    By default the store is ``sqlite:///<run dir>/mlflow.db`` with artifacts in ``<run dir>/mlflow-artifacts``.
    The run id is kept in ``<run dir>/mlflow_run_id``: a job restarted in the same run directory, or resumed from
    a checkpoint of another run logged to the same store, continues that run.
    """

    def __init__(
        self, *, tracking_uri: str | None, experiment_name: str, run_name: str | None, tags: dict[str, str]
    ) -> None:
        self.tracking_uri, self.experiment_name = tracking_uri, experiment_name
        self.run_name, self.tags = run_name, tags
        self.client: Any = None
        self.run_id = ""

    def check(self) -> None:
        """The package, and a URI this tracker can reach: a local store's directory exists, a server answers."""
        require_package("mlflow", "mlflow")
        if self.tracking_uri is None:
            require_package("sqlalchemy", "mlflow")  # the default sqlite store
            return
        uri = self.tracking_uri
        parsed = urlparse(uri)
        scheme = parsed.scheme.split("+")[0]
        if scheme in ("", "file"):
            store = Path(parsed.path if scheme else uri)
            if store.is_file():
                raise TrackerSetupError("tracking_uri", uri, f"{ALLOWED_URIS} (this path is a file)")
        elif scheme == "sqlite":
            database = Path(uri.split(":///", 1)[-1]) if ":///" in uri else None
            if database is None or not _creatable(database.parent):
                raise TrackerSetupError("tracking_uri", uri, f"{ALLOWED_URIS} (no writable directory for the file)")
        elif scheme in REMOTE_SCHEMES:
            _check_reachable(uri, parsed.hostname, parsed.port or (443 if scheme == "https" else 80))
        elif scheme not in DATABASE_SCHEMES and scheme != "databricks":
            raise TrackerSetupError("tracking_uri", uri, ALLOWED_URIS)

    def start(
        self,
        *,
        run_dir: str,
        run_name: str,
        run_group: str | None,
        config: dict[str, Any],
        resumed_from: str | None,
        initial_step: int,
    ) -> None:
        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow", "alembic"):  # after the import, which sets mlflow's level: no migration notices
            logging.getLogger(noisy).setLevel(logging.WARNING)

        directory = Path(run_dir)
        uri = self.tracking_uri or f"sqlite:///{(directory / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self._continued_run(directory, resumed_from) or self._new_run(directory, run_name, run_group)
        (directory / MLFLOW_ID_FILE).write_text(self.run_id + "\n")
        self._log_params(flat_params(config))
        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")
        log.info("MLflow run %s in %s", self.run_id, uri)

    def _continued_run(self, run_dir: Path, resumed_from: str | None) -> str | None:
        """The run this job continues, if its id is recorded and the store knows it."""
        candidates = [run_dir / MLFLOW_ID_FILE]
        if resumed_from:
            candidates.append(Path(resumed_from).resolve().parents[1] / MLFLOW_ID_FILE)
        for candidate in candidates:
            if candidate.is_file():
                run_id = candidate.read_text().strip()
                try:
                    self.client.get_run(run_id)
                except Exception:  # noqa: BLE001 - MLflow raises its own error for an unknown run id
                    continue
                self.client.update_run(run_id, status="RUNNING")
                return run_id
        return None

    def _new_run(self, run_dir: Path, run_name: str, run_group: str | None) -> str:
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            local_store = self.tracking_uri is None or self.tracking_uri.startswith("sqlite:")
            artifacts = (run_dir / "mlflow-artifacts").resolve().as_uri() if local_store else None
            experiment_id = self.client.create_experiment(self.experiment_name, artifact_location=artifacts)
        tags = dict(self.tags) | ({"group": run_group} if run_group else {})
        run = self.client.create_run(experiment_id, run_name=self.run_name or run_name, tags=tags)
        return run.info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """Log the params not logged yet; a continued run keeps its first values (MLflow forbids changing them)."""
        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(key for key, value in params.items() if key in logged and logged[key] != value)
        if changed:
            log.info("MLflow run keeps its first values of %d changed params (%s)", len(changed), ", ".join(changed))
        from mlflow.entities import Param

        fresh = [Param(key, value) for key, value in params.items() if key not in logged]
        for start in range(0, len(fresh), BATCH_LIMIT):
            self.client.log_batch(self.run_id, params=fresh[start : start + BATCH_LIMIT])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, record["step"]) for key, value in numeric_metrics(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict[str, Any]) -> None:
        self.client.log_text(self.run_id, strict_json(summary, indent=2), "summary.json")
        self.client.set_terminated(self.run_id, status="KILLED" if summary.get("stopped_by") else "FINISHED")


def _creatable(directory: Path) -> bool:
    """The directory exists, or its nearest existing ancestor is a directory where it can be made."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return candidate.is_dir()
    return False


def _check_reachable(uri: str, host: str | None, port: int) -> None:
    """A TCP connection to the tracking server, so a wrong host or port is refused now, not after MLflow's retries."""
    if not host:
        raise TrackerSetupError("tracking_uri", uri, f"{ALLOWED_URIS} (no host)")
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise TrackerSetupError("tracking_uri", uri, f"a reachable tracking server ({err.strerror or err})") from None
