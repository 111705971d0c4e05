"""MLflow, in the run directory: a SQLite store (``mlflow.db``) and its artifacts (``mlflow-artifacts/``), so nothing
is sent anywhere, unless the user's own ``MLFLOW_TRACKING_URI`` names a server (MLflow's telemetry is off either
way). ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`` shows it. Experiment ``MLFLOW_EXPERIMENT_NAME``
(default ``localrl``), run name the run directory's, tagged with its path; a resumed run continues the same MLflow
run (found by that tag; the steps after the checkpoint, computed again, are logged again: the last value of a step
is the run's). The config is the run's parameters; warnings and notes are text artifacts, the learning curve an
image artifact."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from localrl.runs import Run
from localrl.trackers import Tracker, trackers

DEFAULT_EXPERIMENT = "localrl"
RUN_TAG = "localrl.run_dir"
PARAMS_PER_CALL = 100  # MLflow's limit on a batch's parameters
PARAM_CHARS = 6000  # and on a value's length


@trackers.register("mlflow")
class MLflow(Tracker):
    requires = "mlflow,sqlalchemy,alembic"  # (the SQLite store needs the last two; mlflow-skinny has neither)
    extra = "mlflow"

    def __init__(self, run: Run, config: dict, first_step: int, log: Callable[[str], None]):
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # (usage reports go to a server)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their store's set-up lines would break the progress bar's
            logging.getLogger(name).setLevel(logging.WARNING)

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run.mlflow_store.resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(
            name, artifact_location=run.mlflow_artifacts_dir.resolve().as_uri())
        path = str(run.path.resolve())
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{path}'",
                                        max_results=1) if first_step else []
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run.path.name,
                                                 tags={RUN_TAG: path}).info.run_id
            params = [Param(k, repr(v)[:PARAM_CHARS]) for k, v in config.items()]
            for i in range(0, len(params), PARAMS_PER_CALL):
                self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_CALL])
        log(f"report_to mlflow: run {self.run_id} of experiment {name} in {uri}"
            + (f" (mlflow ui --backend-store-uri {uri})" if uri.startswith("sqlite:") else ""))

    def scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def text(self, tag: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{tag}s/{step:06d}-{time.time_ns()}.txt")  # (at step, then when)

    def image(self, tag: str, png: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(png))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
