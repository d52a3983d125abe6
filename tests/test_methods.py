"""The training methods' registry (lit_qlora.methods.METHODS): every method's verb, spec and refusals, stated once
and read alike by the verb, its spec's --strategy choices and `litqlora estimate --method`."""

from __future__ import annotations

import typing
from dataclasses import fields, replace

import pytest

from lit_qlora.base.errors import UserError
from lit_qlora.cli import commands
from lit_qlora.estimate.args import EstimateSpec
from lit_qlora.estimate.command import method_for
from lit_qlora.methods import METHODS
from lit_qlora.train.args import DataArgs
from lit_qlora.train.method import STRATEGIES


def test_every_method_is_a_verb_with_its_spec():
    assert list(METHODS) == ["sft", "dpo", "grpo", "kto"]
    table = commands()
    for method in METHODS.values():
        assert table[method.verb] is method.command
        assert typing.get_type_hints(method.command)["spec"] == typing.Optional[method.spec_class]
        if method.section:
            assert method.section in {f.name for f in fields(method.spec_class)}
    choice = next(arm for arm in typing.get_args(typing.get_type_hints(EstimateSpec)["method"]) if arm is not type(None))
    assert typing.get_args(choice) == tuple(METHODS)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_refused_strategy_is_not_offered_and_the_verb_and_the_estimate_say_the_same(name, tmp_path):
    method = METHODS[name]
    offered = typing.get_args(typing.get_type_hints(method.spec_class)["strategy"])
    assert tuple(offered) == method.strategies()
    for key, reason in method.refusals.items():
        assert reason.strip() and key.split()[0] in ("strategy", "packing", "compile")
    for strategy in set(STRATEGIES) - set(offered):
        spec = method.spec_class(checkpoint_dir=tmp_path / "no-model", out_dir=tmp_path / "out")
        spec = replace(spec, strategy=strategy)
        with pytest.raises(UserError) as verb:
            method.command(spec)
        estimate_spec = EstimateSpec(method=name, strategy=strategy)
        with pytest.raises(UserError) as estimate:
            method_for(estimate_spec, name)
        reason = method.refusals[f"strategy {strategy}"]
        assert reason in str(verb.value) and str(estimate.value) == f"--method {name}: {verb.value}"


@pytest.mark.parametrize("name", [n for n, m in METHODS.items() if "packing" in m.refusals])
def test_packing_is_refused_once_with_its_reason(name, tmp_path):
    method = METHODS[name]
    spec = method.spec_class(checkpoint_dir=tmp_path / "no-model", out_dir=tmp_path / "out")
    spec = replace(spec, data=replace(spec.data, packing=True))
    with pytest.raises(UserError, match="does not take --data.packing true") as verb:
        method.command(spec)
    assert method.refusals["packing"] in str(verb.value)
    with pytest.raises(UserError) as estimate:
        method_for(EstimateSpec(method=name, data=replace(EstimateSpec().data, packing=True)), name)
    assert str(estimate.value) == f"--method {name}: {verb.value}"
    assert isinstance(spec.data, DataArgs)


def test_the_estimate_asks_the_method_and_never_its_name():
    """estimate's report and its sections come from the method object (batch_unit, estimate_section,
    render_estimate): adding a method edits no branch there."""
    import ast
    from pathlib import Path

    import lit_qlora.estimate.command as command

    tree = ast.parse(Path(command.__file__).read_text(encoding="utf-8"))
    names = {method.name for method in METHODS.values()}
    compared = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators])]
    assert compared == []
    assert METHODS["dpo"].batch_size(3) == "3 pairs (6 sequences)" and METHODS["sft"].batch_size(3) == "3"
    assert METHODS["sft"].render_estimate({"method": "sft"}) == []
