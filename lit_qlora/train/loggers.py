"""`--logger`: where a fine-tune's scalars go besides metrics.jsonl, built from Lightning's loggers. Each gets the
same scalars (train/loss, train/lr, train/grad_norm, train/tokens_per_sec, train/tokens, memory/peak_bytes against
the optimizer step; val/loss at every validation) and the run's settings as hyperparameters, keyed by option name.

* tensorboard: OUT/logs (`tensorboard --logdir OUT/logs`), the default;
* csv: OUT/csv/metrics.csv and OUT/csv/hparams.yaml;
* wandb: a W&B run under OUT/wandb, offline unless you are logged in (WANDB_API_KEY or `wandb login`) or set
  WANDB_MODE yourself (`wandb sync OUT/wandb/offline-run-*` uploads an offline run later); project `lit-qlora` unless
  WANDB_PROJECT says otherwise;
* mlflow: an MLflow run in OUT/mlruns, MLflow's file store (MLflow 3 keeps it behind MLFLOW_ALLOW_FILE_STORE=true,
  which is set for this; `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri OUT/mlruns`), unless
  MLFLOW_TRACKING_URI is set; experiment `lit-qlora` unless MLFLOW_EXPERIMENT_NAME says otherwise.

Lightning finalizes its loggers after every `validate()` and `fit()`; a fine-tune runs both several times, so here
finalizing only flushes and `close_loggers` ends the runs once, at the end.
"""

from __future__ import annotations

import csv
import io
import json
import netrc
import os
from pathlib import Path
from typing import Any, Literal, Sequence, Union

from lit_qlora.base.errors import UserError

LoggerName = Literal["tensorboard", "csv", "wandb", "mlflow"]
LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")
# What each needs that lit-qlora does not install: the error names the package to install.
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow (or mlflow-skinny)"}


def require_loggers(names: Union[str, Sequence[str]]) -> list[str]:
    """The --logger names, checked (known, each once, its package installed)."""
    import importlib.util

    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in LOGGERS]
    if unknown or not names:
        raise UserError(f"--logger {' '.join(unknown) or '(none)'}: choose one or more of {', '.join(LOGGERS)} "
                         "(several as --logger '[tensorboard,csv]').")
    if len(set(names)) != len(names):
        raise UserError(f"--logger names {', '.join(names)}: each logger once.")
    for name in names:
        if name in PACKAGES and importlib.util.find_spec(name) is None:
            raise UserError(f"--logger {name} needs the `{name}` package, which is not installed: "
                             f"pip install {PACKAGES[name].split(' ')[0]}, or choose another logger.")
    return names


def wandb_offline() -> bool:
    """Offline unless logged in; a WANDB_MODE the user set is left to wandb."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"] in ("offline", "dryrun")
    if os.environ.get("WANDB_API_KEY"):
        return False
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is None
    except (OSError, netrc.NetrcParseError):
        return True


_OWN_MLFLOW_STORES: set[str] = set()
"""The local MLflow stores (OUT/mlruns URIs) runs in this process chose."""


def build_loggers(names: Sequence[str], out_dir: Path, start_step: int) -> list[Any]:
    """Lightning loggers for `names`; a resumed run (start_step > 0) drops what the interrupted run logged after
    its checkpoint, so each step shows once."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger

    from lit_qlora.train.tensorboard import RunTensorBoardLogger

    class RunCSVLogger(CSVLogger):
        def finalize(self, status: str) -> None:
            self.save()

    class RunWandbLogger(WandbLogger):
        def finalize(self, status: str) -> None:
            pass

        def close(self) -> None:
            if self._experiment is not None:
                self._experiment.finish()

    class RunMLFlowLogger(MLFlowLogger):
        def finalize(self, status: str) -> None:
            pass

        def close(self) -> None:
            super().finalize("success")

    loggers = []
    for name in names:
        if name == "tensorboard":
            loggers.append(RunTensorBoardLogger(out_dir, start_step))
        elif name == "csv":
            if start_step:
                _drop_rows_after(out_dir / "csv" / "metrics.csv", start_step)
            loggers.append(RunCSVLogger(save_dir=str(out_dir), name="", version="csv"))
        elif name == "wandb":
            out_dir.mkdir(parents=True, exist_ok=True)  # wandb writes out_dir/wandb
            loggers.append(RunWandbLogger(save_dir=str(out_dir), name=out_dir.name, offline=wandb_offline(),
                                          project=os.environ.get("WANDB_PROJECT", "lit-qlora")))
        elif name == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI")
            # mlflow.set_tracking_uri exports the URI to the environment (for subprocesses): one of our own local
            # stores found there is an earlier run's in this process, not the user's choice
            if not uri or uri in _OWN_MLFLOW_STORES:  # a local store needs no server
                uri = (out_dir.resolve() / "mlruns").as_uri()
                _OWN_MLFLOW_STORES.add(uri)
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind it
            loggers.append(RunMLFlowLogger(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", "lit-qlora"),
                                           run_name=out_dir.name, tracking_uri=uri))
    return loggers


def jsonl_rows_through(path: Path, step: int) -> list[str]:
    """The lines of a JSON-lines log (metrics.jsonl, samples.jsonl) whose "step" is at most `step`, none when the file
    is missing: what a run resumed after `step` keeps of it, as it trains the later steps again."""
    if not path.is_file():
        return []
    return [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]


def _drop_rows_after(path: Path, step: int) -> None:
    """metrics.csv's rows up to `step` (the CSV logger's counterpart of jsonl_rows_through), rewritten atomically."""
    from lit_qlora.checkpoint.files import atomic_write_text

    if not path.is_file():
        return
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames or [], [r for r in reader if float(r.get("step") or 0) <= step]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, text.getvalue())


def log_settings(loggers: Sequence[Any], settings: dict[str, Any]) -> None:
    """The run's settings, flattened to option names (`lora.r`, `train.lr`), as every logger's hyperparameters."""
    from lit_qlora.train.args import flatten

    flat = flatten(settings)
    for logger in loggers:
        if hasattr(logger, "log_settings"):  # TensorBoard: its HPARAMS tab beside the losses
            logger.log_settings(settings)
        else:
            logger.log_hyperparams(flat)


def log_scalars(loggers: Sequence[Any], scalars: dict[str, float], step: int) -> None:
    for logger in loggers:
        logger.log_metrics(scalars, step=step)


def close_loggers(loggers: Sequence[Any]) -> None:
    for logger in loggers:
        if hasattr(logger, "close"):
            logger.close()
        else:
            logger.finalize("success")
