"""`ModelChoice` (lit_qlora.deploy.choice): generate, chat, serve and evaluate name their model with the same five
options, one default each, and resolve precision once."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from lit_qlora.base.precision import PRECISION_DTYPES, resolved
from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT
from lit_qlora.cli import build_parser, commands
from lit_qlora.cli.usage import spec_class
from lit_qlora.deploy.choice import ModelChoice

INFERENCE_VERBS = ("generate", "chat", "serve", "evaluate")
MODEL_FIELDS = ("checkpoint_dir", "adapter_dir", "quantize", "precision", "device")


def test_every_inference_command_takes_the_one_model_choice():
    table = commands()
    shared = {f.name: (f.default, typing.get_type_hints(ModelChoice)[f.name]) for f in dataclasses.fields(ModelChoice)}
    assert tuple(shared) == MODEL_FIELDS
    assert shared["checkpoint_dir"][0] == DEFAULT_CHECKPOINT  # one default, the bundled model, for every command
    for verb in INFERENCE_VERBS:
        spec = spec_class(table[verb])
        assert spec is not None and issubclass(spec, ModelChoice), verb
        hints = typing.get_type_hints(spec)
        assert {f.name: (f.default, hints[f.name]) for f in dataclasses.fields(spec) if f.name in shared} == shared


def test_the_model_flags_read_the_same_in_every_inference_command():
    from jsonargparse import set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = build_parser(commands())
    required = {"generate": ["--prompt", "hi"], "evaluate": ["--tasks", "truthfulqa_mc2"]}
    for verb in INFERENCE_VERBS:
        cfg = parser.parse_args([verb, *required.get(verb, []), "--adapter_dir", "out/a", "--quantize", "nf4",
                                 "--precision", "32-true", "--device", "cpu"])
        built = parser.instantiate(cfg)[verb]
        assert {name: str(built[name]) for name in MODEL_FIELDS} == {
            "checkpoint_dir": str(DEFAULT_CHECKPOINT), "adapter_dir": "out/a", "quantize": "nf4",
            "precision": "32-true", "device": "cpu"}, verb


def test_precision_is_resolved_once_by_the_choice_and_the_loader_takes_only_a_resolved_one(tiny_llama_dir):
    from lit_qlora.checkpoint.loading import load_model

    choice = ModelChoice(checkpoint_dir=tiny_llama_dir, device="cpu")
    assert choice.run_precision == resolved("auto", "cpu") and choice.run_precision in PRECISION_DTYPES
    assert ModelChoice(precision="32", device="cpu").run_precision == "32-true"  # Lightning's short name
    model = choice.load()
    assert next(model.parameters()).dtype == PRECISION_DTYPES[choice.run_precision]
    with pytest.raises(ValueError, match="resolve it first"):
        load_model(tiny_llama_dir, "none", "auto")


def test_a_choice_is_checked_before_anything_loads(tmp_path):
    from lit_qlora.base.errors import UserError

    with pytest.raises(UserError, match="config.json"):
        ModelChoice(checkpoint_dir=tmp_path).check()
    with pytest.raises(UserError, match="--device 'gpu0' is not a device"):
        ModelChoice(device="gpu0").run_device  # noqa: B018
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            ModelChoice(device="cuda").run_device  # noqa: B018
    with pytest.raises(TypeError, match="not both"):
        from lit_qlora.deploy.generate import GenerateSpec, generate_command

        generate_command(GenerateSpec(prompt="hi"), prompt="hello")


def test_a_choice_loads_on_its_device_with_the_adapters_quantize(tiny_llama_dir, tmp_path):
    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.nf4 import is_nf4

    model = load_model(tiny_llama_dir, "nf4", "32-true")
    apply_lora(model, r=2, alpha=4, dtype=torch.float32)
    save_adapter(model, tmp_path / "final", {"r": 2, "alpha": 4, "targets": ["all"], "quantize": "nf4",
                                             "base_dtype": "bfloat16", "lora_dtype": "float32"})
    choice = ModelChoice(checkpoint_dir=tiny_llama_dir, adapter_dir=tmp_path, precision="32-true", device="cpu")
    choice.check()
    assert choice.run_quantize == "nf4"  # what the adapter trained with
    loaded = choice.load()
    assert any(is_nf4(p) for p in loaded.parameters()) and next(loaded.parameters()).device.type == "cpu"
    assert ModelChoice(checkpoint_dir=tiny_llama_dir, adapter_dir=tmp_path, quantize="none").run_quantize == "none"
