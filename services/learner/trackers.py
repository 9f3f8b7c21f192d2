"""Where the learner's statistics also go (``run.trackers``): TensorBoard, MLflow, W&B.

Each is fed the lines of ``metrics.jsonl`` as they are written (the one table of learner statistics; a line's
``step`` is the update), gets the run's config, flattened, as parameters at its start, and at the end the final
models, the eval answers and the report as artifacts. A learner that resumes from its checkpoint continues the
runs it started (their ids are kept in ``<run.dir>/trackers.json``); a run from scratch starts new ones.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from common.config import ConfigError, RunConfig

__all__ = ["Trackers", "check_trackers", "flatten"]

IDS = "trackers.json"


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` → ``{"a.b": "1"}``: every leaf of the config as a string parameter."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


def scalars(record: dict) -> dict[str, float]:
    """The numeric statistics of one metrics line (lists such as ``groups`` are not scalars)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


class _TensorBoard:
    def __init__(self, config: RunConfig, run_dir: Path, resumed_id: str | None):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.id = str(run_dir / "tensorboard")
        if resumed_id is None:
            self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flatten(_config(config)).items()))

    def log(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def artifacts(self, paths: list[Path]) -> None:
        pass  # TensorBoard keeps no files; the run directory holds them

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, config: RunConfig, run_dir: Path, resumed_id: str | None):
        import mlflow

        options = config.run.tracking
        uri = options.mlflow_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = mlflow.MlflowClient(uri)
        experiment = self.client.get_experiment_by_name(options.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                options.project,
                artifact_location=None if options.mlflow_uri else (run_dir / "mlartifacts").resolve().as_uri(),
            )
        )
        if resumed_id is not None:
            self.id = resumed_id
            self.client.update_run(self.id, status="RUNNING")
        else:
            run = self.client.create_run(
                experiment_id, run_name=config.run.run_id, tags={"streamppo.run_id": config.run.run_id}
            )
            self.id = run.info.run_id
            params = flatten(_config(config))
            keys = sorted(params)
            for start in range(0, len(keys), 100):  # MLflow takes at most 100 parameters per batch
                batch = [mlflow.entities.Param(k, params[k][:6000]) for k in keys[start : start + 100]]
                self.client.log_batch(self.id, params=batch)
        self.uri = uri

    def log(self, record: dict) -> None:
        import mlflow

        stamp = int(record.get("time", 0) * 1000)
        metrics = [mlflow.entities.Metric(k, v, stamp, record["step"]) for k, v in scalars(record).items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.id, metrics=metrics[start : start + 1000])

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.id, str(path), artifact_path=path.name)
            elif path.exists():
                self.client.log_artifact(self.id, str(path))
        self.client.set_terminated(self.id, "FINISHED")

    def close(self) -> None:
        pass


class _WandB:
    def __init__(self, config: RunConfig, run_dir: Path, resumed_id: str | None):
        import wandb

        options = config.run.tracking
        self.wandb = wandb
        self.run = wandb.init(
            project=options.project,
            name=config.run.run_id,
            dir=str(run_dir),
            mode=options.wandb_mode,
            config=_config(config),
            id=resumed_id,
            resume="allow" if resumed_id else None,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        self.id = self.run.id

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def artifacts(self, paths: list[Path]) -> None:
        artifact = self.wandb.Artifact(f"{self.run.name}-final", type="model")
        for path in paths:
            if path.is_dir():
                artifact.add_dir(str(path), name=path.name)
            elif path.exists():
                artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self) -> None:
        self.run.finish()


KINDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}
# What each needs importable, and the packages that provide it (pyproject's `trackers` extra, or tensorboard).
NEEDS = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny SQLAlchemy alembic"),
    "wandb": (("wandb",), "wandb"),
}


def check_trackers(config: RunConfig) -> None:
    """A :class:`ConfigError` naming each tracker of ``run.trackers`` whose library is not installed."""
    missing = [
        f"{name} (pip install {NEEDS[name][1]})"
        for name in config.run.trackers
        if any(importlib.util.find_spec(module) is None for module in NEEDS[name][0])
    ]
    if missing:
        raise ConfigError(f"run.trackers: not installed here: {', '.join(missing)}")


def _config(config: RunConfig) -> dict:
    return json.loads(config.model_dump_json())


class Trackers:
    """The run's trackers (none until :meth:`open`)."""

    def __init__(self):
        self.open_trackers: dict = {}

    @classmethod
    def open(cls, config: RunConfig, run_dir: Path, resumed: bool) -> Trackers:
        """Those of ``run.trackers``, continuing the runs of the last start when the learner ``resumed``."""
        trackers, path = cls(), Path(run_dir) / IDS
        known = json.loads(path.read_text()) if resumed and path.exists() else {}
        check_trackers(config)
        for name in config.run.trackers:
            trackers.open_trackers[name] = KINDS[name](config, Path(run_dir), known.get(name))
        if trackers.open_trackers:
            ids = {name: tracker.id for name, tracker in trackers.open_trackers.items()}
            path.write_text(json.dumps(ids) + "\n")
        return trackers

    def log(self, records: list[dict]) -> None:
        for record in records:
            for tracker in self.open_trackers.values():
                tracker.log(record)

    def finish(self, run_dir: Path) -> None:
        """Send the run's results as artifacts: the final models, metrics.jsonl, the eval answers and, where
        matplotlib is installed, the report (``streamppo report``'s plots and summary)."""
        if not self.open_trackers:
            return
        run_dir = Path(run_dir)
        paths = [run_dir / "final", run_dir / "metrics.jsonl", *sorted(run_dir.glob("generations*"))]
        if importlib.util.find_spec("matplotlib") is not None:
            from common.report import write_report

            write_report(run_dir)
            paths.append(run_dir / "report")
        for tracker in self.open_trackers.values():
            tracker.artifacts(paths)

    def close(self) -> None:
        for tracker in self.open_trackers.values():
            tracker.close()
        self.open_trackers = {}
