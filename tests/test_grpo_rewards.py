"""lit_qlora.methods.grpo.rewards: loading reward functions from --grpo.rewards, calling them as TRL does, the built-ins'
numbers, and the error messages for everything a user can get wrong."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lit_qlora.base.errors import UserError
from lit_qlora.methods.grpo.builtin_rewards import BUILTINS, DEFAULT_FORMAT_PATTERN, answer_match, format_reward
from lit_qlora.methods.grpo.rewards import Reward, check_columns, load_rewards, score, total


def _batch(completions: list, prompts: list | None = None, **columns: list) -> dict:
    """score's keyword arguments for `completions` (rows 1..n of train.jsonl)."""
    n = len(completions)
    return dict(prompts=prompts if prompts is not None else [f"prompt {i + 1}" for i in range(n)],
                completions=completions, completion_ids=[[1, 2, 3][: i + 1] for i in range(n)], columns=columns,
                rows=list(range(1, n + 1)), source="train.jsonl")


def _write(path: Path, code: str) -> Path:
    path.write_text(textwrap.dedent(code))
    return path


# --- Loading -------------------------------------------------------------------------------------------------------

def test_builtins_by_name_with_their_metric_names_and_default_weights():
    rewards = load_rewards(["answer_match", "format"])
    assert [r.name for r in rewards] == ["answer_match", "format"]
    assert rewards[0].fn is answer_match and rewards[1].fn is format_reward
    assert [r.weight for r in rewards] == [1.0, 1.0]
    assert set(BUILTINS) == {"answer_match", "format"}


def test_file_form_relative_to_the_current_directory(tmp_path, monkeypatch):
    _write(tmp_path / "my_rewards.py", """
        def my_reward(completions, **kwargs):
            return [float(len(c)) for c in completions]
    """)
    monkeypatch.chdir(tmp_path)
    (reward,) = load_rewards(["my_rewards.py:my_reward"], weights=[0.5])
    assert reward.name == "my_reward" and reward.weight == 0.5
    out = score([reward], **_batch(["ab", "abcd"]))
    assert out.dtype == torch.float32 and out.tolist() == [[2.0], [4.0]]


def test_file_form_absolute_path_and_two_functions_of_one_file(tmp_path):
    path = _write(tmp_path / "rewards.py", """
        import dataclasses

        @dataclasses.dataclass  # needs its module in sys.modules while the file runs
        class Unit:
            value: float = 1.0

        def one(completions, **kwargs):
            return [Unit().value for _ in completions]

        def two(completions, **kwargs):
            return [2.0 for _ in completions]
    """)
    rewards = load_rewards([f"{path}:one", f"{path}:two"])
    assert [r.name for r in rewards] == ["one", "two"]
    # one load of the file: both functions share its module
    assert rewards[0].fn.__globals__ is rewards[1].fn.__globals__
    assert score(rewards, **_batch(["x"])).tolist() == [[1.0, 2.0]]


def test_module_form(tmp_path, monkeypatch):
    package = tmp_path / "reward_pkg_for_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _write(package / "checks.py", """
        def is_short(completions, **kwargs):
            return [1.0 if len(c) < 5 else 0.0 for c in completions]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    (reward,) = load_rewards(["reward_pkg_for_test.checks:is_short"])
    assert reward.name == "is_short"
    assert score([reward], **_batch(["hi", "a long one"])).tolist() == [[1.0], [0.0]]


def test_same_names_get_distinct_metric_names(tmp_path):
    path = _write(tmp_path / "r.py", "def answer_match(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    rewards = load_rewards(["answer_match", f"{path}:answer_match", "answer_match", "format"])
    assert [r.name for r in rewards] == ["answer_match", "answer_match_2", "answer_match_3", "format"]


def test_loading_errors_name_the_flag_and_the_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"--grpo\.rewards is empty.*answer_match, format"):
        load_rewards([])
    with pytest.raises(UserError, match=r"--grpo\.rewards names 'correctness'.*not a built-in.*answer_match, format"
                                        r".*path/to/file\.py:function.*package\.module:function"):
        load_rewards(["correctness"])
    with pytest.raises(UserError, match=r"'missing\.py:f'.*the file missing\.py does not exist.*"
                                        + str(tmp_path / "missing.py").replace("\\", "\\\\")):
        load_rewards(["missing.py:f"])
    with pytest.raises(UserError, match=r"'no_such_module_xyz:f'.*cannot be imported.*No module named "
                                        r"'no_such_module_xyz'"):
        load_rewards(["no_such_module_xyz:f"])


def test_errors_for_the_named_function(tmp_path):
    path = _write(tmp_path / "funcs.py", """
        import math  # imported, not defined here: not listed

        THRESHOLD = 3

        def alpha(completions, **kwargs):
            return [0.0] * len(completions)

        def beta(completions, **kwargs):
            return [1.0] * len(completions)

        def _private(completions, **kwargs):
            return []
    """)
    with pytest.raises(UserError, match=r"--grpo\.rewards names '.*funcs\.py:gamma'.*funcs\.py has no 'gamma'; "
                                        r"its functions and classes are: alpha, beta\. Check"):
        load_rewards([f"{path}:gamma"])
    with pytest.raises(UserError, match=r"--grpo\.rewards.*THRESHOLD in the file .*funcs\.py is not a function "
                                        r"\(it is of type int\)"):
        load_rewards([f"{path}:THRESHOLD"])


def test_a_file_that_fails_to_run(tmp_path):
    path = _write(tmp_path / "broken.py", "def f(completions:\n")
    with pytest.raises(UserError, match=r"--grpo\.rewards.*running the file .*broken\.py raised SyntaxError"):
        load_rewards([f"{path}:f"])


def test_weights_and_format_pattern_errors():
    with pytest.raises(UserError, match=r"--grpo\.reward_weights has 1 weight\(s\) but --grpo\.rewards names 2 "
                                        r"reward\(s\) \(answer_match, format\)"):
        load_rewards(["answer_match", "format"], weights=[1.0])
    with pytest.raises(UserError, match=r"--grpo\.reward_weights gives the reward format the weight nan"):
        load_rewards(["answer_match", "format"], weights=[1.0, float("nan")])
    with pytest.raises(UserError, match=r"--grpo\.format_pattern '<answer>\(' is not a valid regular expression"):
        load_rewards(["format"], format_pattern="<answer>(")


# --- score and total -----------------------------------------------------------------------------------------------

def test_weights_and_total_count_none_as_zero():
    def first(completions, **kwargs):
        return [1.0, None, 3.0]

    def second(completions, **kwargs):
        return [None, None, -1.0]

    rewards = [Reward("first", first, 2.0), Reward("second", second, 0.5)]
    per_function = score(rewards, **_batch(["a", "b", "c"]))
    assert per_function.shape == (3, 2)
    assert per_function[0, 0] == 1.0 and math.isnan(per_function[0, 1])
    assert per_function[1].isnan().all() and per_function[2].tolist() == [3.0, -1.0]
    # 2 x 1 + NaN -> 2; all NaN -> 0; 2 x 3 + 0.5 x -1 = 5.5
    assert total(per_function, rewards).tolist() == [2.0, 0.0, 5.5]


def test_weights_from_load_rewards_apply_in_total():
    rewards = load_rewards(["answer_match", "format"], weights=[2.0, 0.25])
    completions = ["<answer>4</answer>", "4", "<answer>5</answer>"]
    per_function = score(rewards, **_batch(completions, answer=["4", "4", "4"]))
    assert per_function.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    assert total(per_function, rewards).tolist() == [2.25, 2.0, 0.25]


def test_values_of_every_accepted_kind():
    import numpy as np

    kinds = {"tuple": lambda completions, **kw: (1, True),
             "numpy": lambda completions, **kw: np.array([0.5, 2.0]),
             "tensor": lambda completions, **kw: torch.tensor([3.0, -1.0]),
             "numpy_scalars": lambda completions, **kw: [np.float32(0.25), np.bool_(True)],
             "tensor_scalars": lambda completions, **kw: [torch.tensor(0.5), torch.tensor(None is None)]}
    out = score([Reward(k, fn) for k, fn in kinds.items()], **_batch(["a", "b"]))
    assert out.tolist() == [[1.0, 0.5, 3.0, 0.25, 0.5], [1.0, 2.0, -1.0, 1.0, 1.0]]


def test_a_function_gets_only_the_arguments_it_declares():
    seen = {}

    def f(completions, answer):
        seen["f"] = (completions, answer)
        return [1.0] * len(completions)

    def g(prompts, completion_ids, *, extra="default"):
        seen["g"] = (prompts, completion_ids, extra)
        return [0.0] * len(prompts)

    def h(**kwargs):
        seen["h"] = sorted(kwargs)
        return [0.0] * len(kwargs["completions"])

    batch = _batch(["x", "y"], answer=["1", "2"], level=[1, 2])
    score([Reward("f", f), Reward("g", g), Reward("h", h)], **batch)
    assert seen["f"] == (["x", "y"], ["1", "2"])
    assert seen["g"] == (["prompt 1", "prompt 2"], [[1], [1, 2]], "default")
    assert seen["h"] == ["answer", "completion_ids", "completions", "level", "prompts"]


def test_a_required_parameter_that_no_column_provides():
    def needs_label(completions, label):
        return [0.0] * len(completions)

    with pytest.raises(UserError, match=r"reward function needs_label \(.*test_grpo_rewards\.py:\d+\) needs 'label'.*"
                                        r"train\.jsonl must have a column 'label'; its columns are: answer, level\. "
                                        r"Rename .* --data\.columns"):
        score([Reward("needs_label", needs_label)], **_batch(["x"], answer=["1"], level=[1]))


def test_check_columns_before_the_first_step():
    rewards = load_rewards(["answer_match", "format"])
    check_columns(rewards, ["answer", "level"], "train.jsonl")  # nothing to say
    with pytest.raises(UserError, match=r"answer_match .*needs 'answer'.*train\.jsonl must have a column 'answer'; its "
                                        r"columns are: level, question\."):
        check_columns(rewards, ["question", "level"], "train.jsonl")


def test_answer_match_without_an_answer_column():
    with pytest.raises(UserError, match=r"answer_match .*needs 'answer'.*must have a column 'answer'; its columns are: "
                                        r"solution\. .*--data\.columns \(e\.g\. '\{solution: answer\}'"):
        score(load_rewards(["answer_match"]), **_batch(["<answer>1</answer>"], solution=["1"]))


def test_conversational_rows():
    prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]] * 2
    completions = [[{"role": "assistant", "content": "<answer>4</answer>"}],
                   [{"role": "assistant", "content": "It is 5"}]]
    rewards = load_rewards(["answer_match", "format"])
    assert score(rewards, **_batch(completions, prompts=prompts, answer=[4, 4])).tolist() == [[1.0, 1.0], [0.0, 0.0]]


# --- Errors from score ---------------------------------------------------------------------------------------------

def test_a_function_that_raises_is_named_with_its_first_failing_row():
    def picky(completions, **kwargs):
        return [1.0 / len(c) for c in completions]  # an empty completion divides by zero

    prompts = ["First prompt", "What is the capital of France? " * 5, "Third"]
    with pytest.raises(UserError) as e:
        score([Reward("picky", picky)], **_batch(["ok", "", "also ok"], prompts=prompts))
    message = str(e.value)
    assert "The reward function picky (" in message and "test_grpo_rewards.py:" in message
    assert "raised ZeroDivisionError: float division by zero on line 2 of train.jsonl" in message
    assert "prompt: 'What is the capital of France? What is" in message and "...'" in message
    assert "Fix the function" in message and "fix or remove the row" in message
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_the_prompt_quoted_for_a_conversational_row_is_the_last_user_message():
    def boom(completions, **kwargs):
        raise KeyError("score")

    prompts = [[{"role": "user", "content": "Old question"}, {"role": "assistant", "content": "Old answer"},
                {"role": "user", "content": "Newest question"}]]
    with pytest.raises(UserError, match=r"raised KeyError: 'score' on line 1 of train\.jsonl "
                                        r"\(prompt: 'Newest question'"):
        score([Reward("boom", boom)], **_batch([[{"role": "assistant", "content": "x"}]], prompts=prompts))


def test_a_function_that_fails_only_on_the_whole_batch_names_its_rows():
    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batches are not supported")
        return [0.0]

    with pytest.raises(UserError, match=r"batch_only .*raised RuntimeError: batches are not supported on the "
                                        r"completions of lines 1-3 of train\.jsonl, though on none of them alone"):
        score([Reward("batch_only", batch_only)], **_batch(["a", "b", "c"]))


@pytest.mark.parametrize("returned, words", [
    ([1.0], r"returned 1 values for 2 completions \(lines 1-2 of train\.jsonl\)"),
    (0.5, r"returned a float, not a list; it must return a list of 2 floats"),
    ({"a": 1.0, "b": 2.0}, r"returned a dict, not a list"),
])
def test_the_wrong_number_or_kind_of_values(returned, words):
    def wrong(completions, **kwargs):
        return returned

    with pytest.raises(UserError, match=r"The reward function wrong \(.*\) " + words):
        score([Reward("wrong", wrong)], **_batch(["a", "b"]))


@pytest.mark.parametrize("value, words", [
    ("yes", r"returned 'yes' for line 2 of train\.jsonl, which is not a real number"),
    (float("nan"), r"returned nan for line 2 of train\.jsonl, which is not finite"),
    (float("inf"), r"returned inf for line 2 of train\.jsonl, which is not finite"),
])
def test_a_value_that_is_not_a_finite_number(value, words):
    def bad(completions, **kwargs):
        return [1.0, value]

    with pytest.raises(UserError, match=r"The reward function bad \(.*\) " + words):
        score([Reward("bad", bad)], **_batch(["a", "b"]))


# --- The built-ins -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>42</answer>", "42", 1.0),
    ("<answer>41</answer> no, <answer> 42 </answer>", "42", 1.0),  # the last tag counts
    ("<answer>42</answer> then <answer>41</answer>", "42", 0.0),
    ("<answer>12.0</answer>", "12", 1.0),
    ("<answer>12</answer>", "12.00", 1.0),
    ("<answer>1/2</answer>", "0.5", 1.0),
    ("<answer>0.333</answer>", "1/3", 0.0),  # exact: a rounded decimal is not the fraction
    ("<answer>$1,234.50</answer>", "1234.5", 1.0),
    ("<answer>25%</answer>", "25", 1.0),
    ("<answer>42.</answer>", 42, 1.0),  # an int column, a trailing period
    ("<answer>0.1</answer>", 0.1, 1.0),  # a float column compares as its decimal
    ("<answer>the answer is 42</answer>", "42", 0.0),  # a tag's content is the answer as a whole
    ("First 3 apples, then 5, so 18 in all.", "18", 1.0),  # no tag: the last number
    ("It costs $1,000 in total.", "1000", 1.0),
    ("Between 17 and 18", "17", 0.0),
    ("See pages 3-4", "4", 1.0),  # a hyphen after a number is no minus sign
    ("x = -3/4.", "-0.75", 1.0),
    ("It is -7", "-7", 1.0),
    ("No numbers here", "3", 0.0),
    ("Step by step...\n####  72\n", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K's answer column
    ("<answer> Paris. </answer>", "paris", 1.0),
    ("<answer>New  York City!</answer>", "new york city", 1.0),
    ("<answer>Lyon</answer>", "Paris", 0.0),
    ("Let me think.\nThe capital is\n  PARIS  \n\n", "Paris", 1.0),  # no tag, text answer: the last non-empty line
    ("Paris\nor maybe Lyon", "Paris", 0.0),
    ("", "Paris", 0.0),
])
def test_answer_match_normalization(completion, answer, expected):
    assert answer_match(completions=[completion], answer=[answer]) == [expected]


def test_answer_match_without_an_expected_answer_does_not_apply():
    assert answer_match(completions=["<answer>1</answer>"] * 3, answer=[None, "  ", "1"]) == [None, None, 1.0]


def test_format_with_the_default_pattern():
    completions = ["Thinking...\n<answer>4</answer>\n", "<answer>4</answer> trailing words", "4",
                   "<answer></answer>", [{"role": "assistant", "content": "because\n<answer>x</answer>"}]]
    (reward,) = load_rewards(["format"])
    assert reward.name == "format" and reward.fn is format_reward
    assert format_reward(completions=completions) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert DEFAULT_FORMAT_PATTERN == r"^.*?<answer>.+?</answer>\s*$"


def test_format_with_a_custom_pattern_and_a_column_called_pattern():
    (reward,) = load_rewards(["format"], format_pattern=r"<think>.+?</think>\s*<answer>.+?</answer>$")
    assert reward.name == "format" and reward.fn.__name__ == "format_reward"
    completions = ["<think>a\nb</think> <answer>4</answer>", "<answer>4</answer>",
                   "x <think>a</think><answer>4</answer>"]
    # matched from the start (re.match), across lines; a dataset column named `pattern` does not replace it
    out = score([reward], **_batch(completions, pattern=["anything"] * 3))
    assert out.flatten().tolist() == [1.0, 0.0, 0.0]


def test_importing_the_module_imports_neither_torch_nor_lightning():
    """The CLI lists BUILTINS in its help, which must stay quick."""
    code = ("import sys, lit_qlora.methods.grpo.rewards; "
            "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_prompts_keep_their_line_in_the_file_through_the_split(tmp_path, tiny_llama_dir):
    """Issue 55 item 8: a reward error said "row 1 of grpo_demo.jsonl" for the first row of the shuffled split, which
    was line 216 of the file. Each prompt keeps its line, and the message says "line" for a JSONL file."""
    import json

    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.methods.grpo.datamodule import GRPODataModule
    from lit_qlora.train.datamodule import DataArgs

    path = tmp_path / "prompts.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(12)]
    path.write_text("\n".join(["", *rows]) + "\n")  # a blank first line: row i is on line i + 2
    dm = GRPODataModule(DataArgs(json_path=path, val_split=0.25), Tokenizer(tiny_llama_dir), 64, 2, 3,
                        num_generations=2, max_completion_length=8)
    dm.setup()
    train, val = dm.train_set.samples, dm.val_set.samples
    assert len(train) == 9 and len(val) == 3
    assert all(s.number == int(s.row["answer"]) + 1 for s in [*train, *val])  # answer i + 1 is on line i + 2
    assert [s.number for s in train] != sorted(s.number for s in train)  # the split shuffled them: numbers kept
    first = train[0]
    with pytest.raises(UserError, match=rf"raised ValueError: no on line {first.number} of prompts\.jsonl "):
        score([Reward("picky", lambda completions, **kw: (_ for _ in ()).throw(ValueError("no")), 1.0)],
              [first.row["prompt"]], ["reply"], [[1]], {"answer": [first.row["answer"]]}, [first.number],
              "prompts.jsonl")
