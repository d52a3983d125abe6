"""The run spec (lit_qlora.train.spec): one typed object the CLI builds once and every training verb passes on, its
fields the verbs' flags; every preset parses to what it parsed to before the spec existed; decide() settles the
spec's open choices once."""

from __future__ import annotations

import inspect
import json
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from lit_qlora.cli.usage import Options
from lit_qlora.base.errors import UserError
from lit_qlora.estimate.args import EstimateSpec
from lit_qlora.methods.grpo.args import GRPOSpec
from lit_qlora.base.precision import choose_precision
from lit_qlora.methods.dpo.args import DPOArgs, DPOSpec, PairTrainArgs
from lit_qlora.train.args import LoRAArgs
from lit_qlora.train.spec import RunSpec, decide

ROOT = Path(__file__).resolve().parents[1]
# `litqlora VERB --config PRESET --print_config` for every preset, with its own verb and with estimate, recorded from
# the code before the run spec (d2f4b4f). A preset's edit or a new option changes it on purpose: regenerate the entry.
PARSED = json.loads((ROOT / "tests" / "data" / "presets_parsed.json").read_text())


def printed_config(command: str, preset: str, capsys) -> dict:
    from lit_qlora.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--config", preset, "--print_config"])
    assert e.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("key", sorted(PARSED))
def test_every_preset_parses_to_the_values_it_parsed_to_before(key, capsys, monkeypatch):
    command, preset = key.split(" ", 1)
    monkeypatch.chdir(ROOT)  # the presets' relative paths as recorded
    assert printed_config(command, preset, capsys) == PARSED[key]


def test_every_preset_is_recorded():
    presets = {str(p.relative_to(ROOT)) for p in (ROOT / "config_hub").rglob("*.yaml")}
    assert {key.split(" ", 1)[1] for key in PARSED} == presets


def test_the_cli_builds_the_spec_once_and_the_verb_gets_it(monkeypatch, tmp_path):
    import lit_qlora.cli as cli

    received = []

    def verb(spec: DPOSpec = None, **settings) -> None:
        """A verb on DPOSpec."""
        received.append((spec, settings))

    monkeypatch.setattr(cli, "commands", lambda: {"dpo": verb})
    cli.main(["dpo", "--out_dir", str(tmp_path), "--lora.r", "4", "--dpo.beta", "0.3", "--train.max_steps", "2",
              "--data.path", "pairs.jsonl"])
    (spec, settings), = received
    assert settings == {} and type(spec) is DPOSpec
    assert spec.out_dir == tmp_path and spec.lora == LoRAArgs(r=4) and spec.dpo == DPOArgs(beta=0.3)
    assert spec.train == PairTrainArgs(max_steps=2) and spec.data.path == "pairs.jsonl" and spec.tensor_parallel == 1


def test_a_verb_offers_its_own_group_and_not_what_it_skips(monkeypatch, capsys):
    import lit_qlora.cli as cli

    def verb(spec: DPOSpec = None, **settings) -> None:
        """A verb on DPOSpec."""

    monkeypatch.setattr(cli, "commands", lambda: {"dpo": verb})
    with pytest.raises(SystemExit) as e:
        cli.main(["dpo", "--tensor_parallel", "2"])
    assert e.value.code == 2
    assert "unknown option `--tensor_parallel`" in capsys.readouterr().err
    options = Options.of(verb)
    assert "dpo.beta" in options.types and "tensor_parallel" not in options.types and "lora.r" in options.types
    assert Options.of(verb).groups == {"lora", "train", "data", "export", "dpo"}


def test_the_verbs_share_one_spec_and_repeat_no_parameter_list():
    from lit_qlora.estimate.command import estimate
    from lit_qlora.methods.dpo.command import dpo
    from lit_qlora.train.finetune import finetune

    for verb in (finetune, dpo, estimate):
        assert list(inspect.signature(verb).parameters) == ["spec", "settings"], verb.__name__
    shared = {f.name for f in fields(RunSpec)}
    assert shared <= {f.name for f in fields(DPOSpec)} and shared <= {f.name for f in fields(EstimateSpec)}
    assert {f.name for f in fields(DPOSpec)} - shared == {"dpo"}
    assert shared <= {f.name for f in fields(GRPOSpec)} and {f.name for f in fields(GRPOSpec)} - shared == {"grpo"}
    assert {f.name for f in fields(EstimateSpec)} - shared == {"device", "device_memory", "method", "dpo", "grpo", "kto"}


def test_a_spec_comes_from_keywords_or_as_itself_not_both():
    spec = RunSpec(seed=3)
    assert RunSpec.of(spec, {}) is spec and RunSpec.of(None, {"seed": 3}) == spec
    with pytest.raises(TypeError, match="not both"):
        RunSpec.of(spec, {"seed": 4})
    with pytest.raises(TypeError):
        RunSpec.of(None, {"no_such_setting": 1})


def test_decide_settles_precision_compile_loggers_and_resume_once(tmp_path):
    decided = decide(RunSpec(out_dir=tmp_path, accelerator="cpu", logger=["csv", "tensorboard"]))
    assert (decided.precision, decided.precision_reason) == choose_precision("auto", "cpu")
    assert decided.precision != "auto" and decided.compile is False and decided.loggers == ("csv", "tensorboard")
    assert decided.resume_from is None
    assert decide(RunSpec(out_dir=tmp_path, accelerator="cpu", precision="32-true", compile=True)).compile is True
    assert decide(RunSpec(out_dir=tmp_path, resume="auto", accelerator="cpu")).resume_from is None  # nothing there yet
    with pytest.raises(UserError, match="not a checkpoint|state.json|does not exist|no checkpoint"):
        decide(RunSpec(out_dir=tmp_path, resume=tmp_path / "missing", accelerator="cpu"))
