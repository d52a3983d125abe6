"""--logger csv|wandb|mlflow and --train.eval_prompt: each logger read back as its own tools store it (CSV, W&B's
offline run file, MLflow's local store) holds the same scalars and settings as metrics.jsonl; the reply logged at
each validation is the adapter's at that step."""

from __future__ import annotations

import csv
import json
import re
import struct
from pathlib import Path

import pytest

from lit_qlora.base.errors import UserError
from lit_qlora.train.args import LoRAArgs, TrainArgs
from lit_qlora.train.loggers import require_loggers, wandb_offline
from helpers import metrics_rows, small_data

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
LOGGERS = ["tensorboard", "csv", "wandb", "mlflow"]


def run(tiny_llama_dir, out_dir, data, logger=LOGGERS, **train_kw):
    from lit_qlora.train.finetune import finetune

    kw = dict(micro_batch_size=2, global_batch_size=4, max_seq_length=64, lr=1e-2, warmup_steps=1, max_steps=20,
              eval_interval=5)
    kw.update(train_kw)
    return finetune(checkpoint_dir=tiny_llama_dir, out_dir=out_dir, quantize="nf4", precision="32-true",
                    accelerator="cpu", lora=LoRAArgs(r=4, alpha=8, dropout=0.1), data=data, train=TrainArgs(**kw),
                    logger=logger)


@pytest.fixture(scope="module")
def logged(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logged")
    summary = run(tiny_llama_dir, tmp / "out", small_data(tmp))
    rows = metrics_rows(tmp / "out")
    train = {r["step"]: r for r in rows if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    return tmp / "out", summary, train, val


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (its LevelDB-style log: 32 KiB blocks of checksum, length, type)."""
    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def wandb_run(out_dir: Path) -> tuple[list[dict], dict]:
    from wandb.proto import wandb_internal_pb2

    (path,) = out_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, config = [], {}
    for raw in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return history, config


def test_csv_holds_the_scalars_and_the_settings(logged):
    out, summary, train, val = logged
    with (out / "csv" / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    got_val = {int(float(r["step"])): float(r["val/loss"]) for r in rows if r.get("val/loss")}
    assert got_val == pytest.approx(val) and sorted(got_val) == [0, 5, 10, 15, 20]
    got_loss = {int(float(r["step"])): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert got_loss == pytest.approx({s: r["loss"] for s, r in train.items()}, rel=1e-6)
    hparams = (out / "csv" / "hparams.yaml").read_text()
    assert "lora.r: 4" in hparams and "train.eval_interval: 5" in hparams


def test_wandb_offline_run_holds_the_scalars_and_the_settings(logged):
    out, _, train, val = logged
    assert wandb_offline()  # no key here: offline
    history, config = wandb_run(out)
    got_val = {int(h["trainer/global_step"]): h["val/loss"] for h in history if "val/loss" in h}
    assert got_val == pytest.approx(val)
    got_loss = {int(h["trainer/global_step"]): h["train/loss"] for h in history if "train/loss" in h}
    assert got_loss == pytest.approx({s: r["loss"] for s, r in train.items()}, rel=1e-6)
    assert config["lora.r"] == 4 and config["train.eval_interval"] == 5 and config["quantize"] == "nf4"


def test_mlflow_local_store_holds_the_scalars_and_the_settings(logged):
    from mlflow.tracking import MlflowClient

    out, _, train, val = logged
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run_info,) = client.search_runs([client.get_experiment_by_name("lit-qlora").experiment_id])
    history = client.get_metric_history(run_info.info.run_id, "val/loss")
    assert {m.step: m.value for m in history} == pytest.approx(val)
    losses = client.get_metric_history(run_info.info.run_id, "train/loss")
    assert {m.step: m.value for m in losses} == pytest.approx({s: r["loss"] for s, r in train.items()}, rel=1e-6)
    params = client.get_run(run_info.info.run_id).data.params
    assert params["lora.r"] == "4" and params["train.eval_interval"] == "5"
    assert run_info.info.status == "FINISHED"


def test_a_later_run_in_the_process_logs_to_its_own_mlflow_store(logged, tiny_llama_dir, tmp_path):
    """MLflow exports the tracking URI a run sets to the environment (MLFLOW_TRACKING_URI, for subprocesses): a later
    run in the same process (`logged` ran one) still writes its own OUT/mlruns, not the earlier run's store."""
    from mlflow.tracking import MlflowClient

    run(tiny_llama_dir, tmp_path / "later", small_data(tmp_path), logger="mlflow", max_steps=2, eval_interval=2)
    client = MlflowClient(tracking_uri=(tmp_path / "later" / "mlruns").resolve().as_uri())
    (run_info,) = client.search_runs([client.get_experiment_by_name("lit-qlora").experiment_id])
    assert [m.step for m in client.get_metric_history(run_info.info.run_id, "train/loss")] == [1, 2]


def test_a_reply_is_logged_at_each_validation_and_is_the_adapters(logged, tiny_llama_dir):
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.model.sampling import generate
    from lit_qlora.checkpoint.tokenizer import Tokenizer

    out, _, _, _ = logged
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 5, 10, 15, 20]
    assert len({r["prompt"] for r in rows}) == 1 and rows[0]["prompt"]  # the first validation row's prompt
    # as the user wrote it (one of small_data's instructions), and as the model read it: the template around it
    assert re.fullmatch(r"Add (\d+) and (\d+)\.", rows[0]["prompt_text"]), rows[0]
    assert rows[0]["prompt"] != rows[0]["prompt_text"] and rows[0]["prompt_text"] in rows[0]["prompt"]
    tokenizer = Tokenizer(tiny_llama_dir)
    model = load_model(tiny_llama_dir, "nf4", "32-true", out / "final")
    ids = tokenizer.encode(rows[0]["prompt"], bos=False)
    reply = tokenizer.decode(list(generate(model, ids, 48, stop_ids=tokenizer.eos_ids)))
    assert reply == rows[-1]["reply"]


def test_an_explicit_eval_prompt_is_answered_and_bad_logger_input_is_refused(tiny_llama_dir, tmp_path, monkeypatch):
    data = small_data(tmp_path)
    run(tiny_llama_dir, tmp_path / "p", data, logger="csv", max_steps=4, eval_interval=2,
        eval_prompt="What is two plus two?")
    rows = [json.loads(line) for line in (tmp_path / "p" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4] and "What is two plus two?" in rows[0]["prompt"]
    assert {r["prompt_text"] for r in rows} == {"What is two plus two?"}
    assert not (tmp_path / "p" / "logs").exists() and (tmp_path / "p" / "csv" / "metrics.csv").is_file()
    with pytest.raises(UserError, match="--logger tensorboards"):
        require_loggers(["tensorboards"])
    with pytest.raises(UserError, match="each logger once"):
        require_loggers(["csv", "csv"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install wandb"):
        require_loggers(["wandb"])
    with pytest.raises(UserError, match="--train.eval_interval"):
        TrainArgs(eval_prompt="hi").require_valid_validation(type("D", (), {"val_split": 0.1})())
