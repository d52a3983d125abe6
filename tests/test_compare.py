"""`litqlora compare`: recipe resolution, the report's numbers against the stages' own files, reruns that skip
finished stages, and clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from lit_qlora.cli import expand_positional
from lit_qlora.eval.compare import check_settings, compare, resolve_recipe, same_recipe
from lit_qlora.eval.report import verdict, verdict_line

REPO = Path(__file__).resolve().parents[1]
HUB = REPO / "config_hub" / "finetune" / "smollm2-135m"


def test_builtin_recipe_is_the_shipped_smollm2_recipe():
    builtin = yaml.safe_load(resolve_recipe(None, None, None))
    for name in ("qlora", "lora"):
        hub = yaml.safe_load((HUB / f"{name}.yaml").read_text())
        for key in ("checkpoint_dir", "precision", "seed"):
            assert builtin[key] == hub[key], (name, key)
        for section in ("lora", "train", "data"):
            for key, value in hub[section].items():
                assert builtin[section][key] == value, (name, section, key)


def test_recipe_overrides_and_checkpoint_dir(tmp_path):
    recipe = yaml.safe_load(resolve_recipe(HUB / "lora.yaml", {"max_steps": 5, "lr": 2e-4}, tmp_path))
    assert recipe["train"]["max_steps"] == 5 and recipe["train"]["lr"] == 2e-4
    assert recipe["train"]["micro_batch_size"] == 4 and recipe["train"]["global_batch_size"] == 8  # from the file
    assert recipe["checkpoint_dir"] == str(tmp_path)
    # compare sets these per run; a recipe's own values must not leak into either run.
    assert not {"out_dir", "quantize", "resume", "config"} & set(recipe)


@pytest.mark.parametrize("recipe, train, message", [
    (None, {"max_stepz": 5}, "--train.max_stepz is not a training setting"),
    (None, {"max_steps": "many"}, "not a valid fine-tune recipe"),
    (Path("nope.yaml"), None, "--config nope.yaml does not exist"),
])
def test_bad_recipe_is_one_clear_error(recipe, train, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        resolve_recipe(recipe, train, None)


def test_config_flag_is_the_recipe():
    argv = ["compare", "--config", "r.yaml", "--config=s.yaml", "--train.max_steps", "3"]
    assert expand_positional(argv) == ["compare", "--recipe", "r.yaml", "--recipe=s.yaml", "--train.max_steps", "3"]
    assert expand_positional(["finetune", "--config", "r.yaml"]) == ["finetune", "--config", "r.yaml"]


def test_verdict_is_one_stderr_of_lora():
    lora = {"truthfulqa_mc2": 0.50, "truthfulqa_mc2_stderr": 0.02}
    inside = verdict(lora, {"truthfulqa_mc2": 0.485})
    outside = verdict(lora, {"truthfulqa_mc2": 0.475})
    assert inside["within_one_stderr"] and not outside["within_one_stderr"]
    assert math.isclose(outside["qlora_minus_lora"], -0.025)
    assert "is within one stderr" in verdict_line(inside) and "NOT within" in verdict_line(outside)
    assert not verdict({"truthfulqa_mc2": 0.5, "truthfulqa_mc2_stderr": None}, {"truthfulqa_mc2": 0.5})[
        "within_one_stderr"]


def test_settings_guard(tmp_path):
    settings = {"recipe": "seed: 1\n", "eval": {"limit": 4}}
    check_settings(tmp_path, settings)
    (tmp_path / "lora").mkdir()
    results = tmp_path / "eval" / "base" / "results.json"
    results.parent.mkdir(parents=True)
    results.write_text("{}")
    check_settings(tmp_path, {**settings, "eval": {"limit": 8}})  # other eval settings: the evals run again
    assert not results.exists()
    assert json.loads((tmp_path / "compare.json").read_text())["eval"] == {"limit": 8}
    with pytest.raises(ValueError, match="another recipe"):
        check_settings(tmp_path, {**settings, "recipe": "seed: 2\n"})


def test_a_finetune_option_added_since_keeps_an_old_comparison():
    """A comparison recorded before finetune gained an option (here tensor_parallel) still resumes, as long as the
    new option is at its default; any real change of recipe is refused."""
    now = resolve_recipe(None, None, None)
    assert "tensor_parallel: 1\n" in now
    older = now.replace("tensor_parallel: 1\n", "")
    assert same_recipe(older, now) and same_recipe(now, older)
    assert not same_recipe(older, now.replace("tensor_parallel: 1", "tensor_parallel: 2"))
    assert not same_recipe(now, now.replace("seed: 1337", "seed: 7"))
    assert not same_recipe(now, now.replace("max_steps: 20", "max_steps: 21"))


@pytest.mark.slow
def test_compare_end_to_end_on_a_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "cmp"
    train = {"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 4, "max_seq_length": 64,
             "save_interval": 1}
    report = compare(checkpoint_dir=tiny_llama_dir, out_dir=out, train=train, limit=4)

    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["runs"] == json.loads(json.dumps(report["runs"]))
    runs = report["runs"]
    assert set(runs) == {"base", "lora", "qlora"}
    for name in runs:
        results = json.loads((out / "eval" / name / "results.json").read_text())
        assert runs[name]["truthfulqa_mc2"] == results["results"]["truthfulqa_mc2"]["acc,none"]
        assert runs[name]["truthfulqa_mc2_stderr"] == results["results"]["truthfulqa_mc2"]["acc_stderr,none"]
        assert 0 < runs[name]["truthfulqa_mc2"] < 1 and runs[name]["eval_samples"] == 4
        assert results["lit_qlora"]["precision"] == "32-true"
    for name, quantize in (("lora", "none"), ("qlora", "nf4")):
        summary = json.loads((out / name / "summary.json").read_text())
        run = runs[name]
        assert run["quantize"] == quantize and run["steps"] == 2
        assert run["peak_memory_bytes"] == summary["peak_rss_bytes"] > 0
        assert run["train_loss"] == summary["train_loss"] and run["val_loss"] == summary["val_loss"]
        assert run["wall_seconds"] > 0 and run["tokens_per_sec"] > 0
        assert [step for step, _ in run["loss_curve"]] == [1, 2]
        assert all(math.isfinite(loss) for _, loss in run["loss_curve"])
        stage = json.loads((out / "logs" / f"finetune-{name}.json").read_text())
        assert stage["exit_code"] == 0 and stage["command"][0] == "finetune"
        assert run["load_average_1min"] == stage["load_average_1min"] and len(run["load_average_1min"]) == 2
    assert runs["qlora"]["quantized_linears"] == runs["qlora"]["total_linears"] == 14  # (the tied head: the embedding)
    assert runs["lora"]["quantized_linears"] == 0
    # Same recipe and seed: the first step sees the same batch, so the losses differ only by NF4's error.
    assert abs(runs["lora"]["loss_curve"][0][1] - runs["qlora"]["loss_curve"][0][1]) < 0.05
    assert runs["base"]["train_loss"] is None and runs["base"]["peak_memory_bytes"] is None
    assert runs["base"]["val_loss"] == json.loads((out / "lora" / "summary.json").read_text())["initial_val_loss"]
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recipe["train"]["max_steps"] == 2 and recipe["checkpoint_dir"] == str(tiny_llama_dir)

    expected = verdict(runs["lora"], runs["qlora"])
    assert report["verdict"] == expected
    markdown = (out / "report.md").read_text()
    assert verdict_line(expected) in markdown
    assert "Load average (1 min, start/end) during the LoRA fine-tune" in markdown
    for label in ("| base (no fine-tune) |", "| LoRA |", "| QLoRA |"):
        assert label in markdown
    assert f"{runs['qlora']['truthfulqa_mc2']:.4f} ± {runs['qlora']['truthfulqa_mc2_stderr']:.4f}" in markdown
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "logs" / "finetune-qlora.log").read_text().count("NF4 linears") == 1

    # A rerun finds every stage finished: no fine-tune or evaluation runs again, and the report is the same.
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")}
    stamps.update({p: p.stat().st_mtime_ns for p in out.glob("eval/*/results.json")})
    capsys.readouterr()
    again = compare(checkpoint_dir=tiny_llama_dir, out_dir=out, train=train, limit=4)
    assert "[compare]" not in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert again["runs"] == report["runs"]
