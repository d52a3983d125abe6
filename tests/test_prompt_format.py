"""Train as you serve: one prompt format from training to every deployment. `--data.prompt_style auto` (the default)
trains an instruct checkpoint in its own chat template and a base model in alpaca; the style is recorded beside the
adapter; generate, chat and serve feed the model the very token ids a training sample of the conversation holds
before its reply; the merged and GGUF exports carry the style as their chat template."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from lit_qlora.checkpoint.tokenizer import Tokenizer, _compile
from lit_qlora.data.inference import prompt_ids, trained_tokenizer, use_prompt_style
from lit_qlora.data.prompts import PROMPT_STYLES, get_prompt_style, resolve_prompt_style
from lit_qlora.data.templates import STYLE_TEMPLATES, STYLES
from lit_qlora.data.sft import IGNORE_INDEX, tokenize_rows
from lit_qlora.train.args import DataArgs, ExportArgs, LoRAArgs, TrainArgs
from lit_qlora.train.finetune import finetune

from helpers import CHAT  # the tok and llama3_tok fixtures are conftest's

ROWS = [{"instruction": f"What is {i} plus {i}?", "output": f"{i} plus {i} is {2 * i}."} for i in range(12)]
QUESTION = "What is 7 plus 7?"


def training_prompt(style, messages: list[dict]) -> list[int]:
    """The ids a training sample of `messages` plus a reply holds before that reply (the start of its last run of
    trained tokens: earlier assistant turns train too)."""
    sample = tokenize_rows([{"messages": [*messages, {"role": "assistant", "content": "Fourteen."}]}], style,
                           style.tokenizer, 4096)[0]
    trained = (sample.labels != IGNORE_INDEX).tolist()
    last_run = max(i for i, t in enumerate(trained) if t and (i == 0 or not trained[i - 1]))
    return sample.input_ids[:last_run].tolist()


CONVERSATIONS = [
    [{"role": "user", "content": QUESTION}],
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "What is 2 + 3?"}],
    CHAT["messages"][:4],  # system, user, assistant, user
]


@pytest.mark.parametrize("style", ["alpaca", "chatml", "llama3"])
def test_each_styles_exported_template_renders_what_training_rendered(style, tok, llama3_tok):  # noqa: F811
    tokenizer = llama3_tok if style == "llama3" else tok
    prompt_style = get_prompt_style(style, tokenizer)
    template = _compile(STYLE_TEMPLATES[style])
    for messages in CONVERSATIONS:
        want = prompt_style.generation_prompt({"messages": messages})
        got = template.render(messages=messages, add_generation_prompt=True, bos_token=tokenizer.bos_token or "",
                              eos_token=tokenizer.eos_token or "")
        if style == "llama3":  # the template writes BOS; training's tokenizer adds it by the family's rule
            assert got.startswith(tokenizer.bos_token)
            got = got[len(tokenizer.bos_token):]
        assert got == want, (style, messages)
        # and tokenized as a runtime does (the whole text at once), it is the training sample's prompt
        ids = tokenizer.encode(got, bos=None)
        assert ids == training_prompt(prompt_style, messages)


@pytest.mark.parametrize("style", ["chat_template", "alpaca", "chatml"])
def test_inference_feeds_the_ids_training_saw_for_each_conversation(style, tok):  # noqa: F811
    prompt_style = get_prompt_style(style, tok)
    served = use_prompt_style(Tokenizer(tok.checkpoint_dir), style)
    for messages in CONVERSATIONS:
        want = training_prompt(prompt_style, messages)
        assert prompt_ids(prompt_style, messages) == want
        assert served.encode_chat(messages) == want
    assert served.encode_prompt(QUESTION) == training_prompt(prompt_style, CONVERSATIONS[0])


def test_auto_is_the_chat_template_where_there_is_one_else_alpaca(tok, tmp_path):  # noqa: F811
    assert resolve_prompt_style("auto", tok)[0] == "chat_template"
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(tok.checkpoint_dir / "tokenizer.json", base)
    config = json.loads((tok.checkpoint_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    plain = Tokenizer(base)
    assert not plain.has_chat_template and resolve_prompt_style("auto", plain) == (
        "alpaca", "auto: the checkpoint has no chat template")
    assert resolve_prompt_style("chatml", tok) == ("chatml", "given with --data.prompt_style")


def run(checkpoint_dir, out_dir, tmp_path, **data_kw):
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    return finetune(checkpoint_dir=checkpoint_dir, out_dir=out_dir, precision="32-true", accelerator="cpu",
                    lora=LoRAArgs(r=4, alpha=8, dropout=0.0),
                    data=DataArgs(path=str(tmp_path / "rows.json"), val_split=0.25, **data_kw),
                    train=TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=96, max_steps=1),
                    export=ExportArgs(gguf="f32"))


@pytest.mark.parametrize("style", ["auto", "alpaca"])
def test_a_fine_tune_is_served_and_exported_in_the_format_it_trained_in(style, tiny_llama_dir, tmp_path, monkeypatch):
    """A templated checkpoint (SmolLM2's tokenizer): the default trains in its chat template, an explicit alpaca in
    alpaca; either way generate and the OpenAI server feed the model a training sample's prompt ids, and the merged
    and GGUF exports carry that format as their chat template."""
    import gguf

    from lit_qlora.deploy import generate as generate_module
    from lit_qlora.model import sampling
    from lit_qlora.deploy.choice import ModelChoice
    from lit_qlora.deploy.litserve_api import chat_messages
    from lit_qlora.deploy.worker import ChatAPI

    out = tmp_path / "run"
    run(tiny_llama_dir, out, tmp_path, prompt_style=style)
    trained = "chat_template" if style == "auto" else style
    adapter_config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter_config["prompt_style"] == trained
    training = training_prompt(get_prompt_style(trained, Tokenizer(tiny_llama_dir)),
                               [{"role": "user", "content": QUESTION}])

    fed = []
    monkeypatch.setattr(sampling, "generate", lambda model, ids, *a, **kw: fed.append(list(ids)) or iter(()))
    generate_module.generate_command(prompt=QUESTION, checkpoint_dir=tiny_llama_dir, adapter_dir=out, max_new_tokens=1)
    assert fed == [training]
    api = ChatAPI(ModelChoice(checkpoint_dir=tiny_llama_dir, adapter_dir=out, precision="32-true"), 8)  # the OpenAI server's worker, as LitServe sets it up
    api.setup("cpu")
    request = SimpleNamespace(messages=[SimpleNamespace(role="user", content=QUESTION)])
    assert api.tokenizer.encode_chat(chat_messages(request)) == training
    assert trained_tokenizer(tiny_llama_dir, out).encode_prompt(QUESTION) == training  # chat's and generate's

    base_template = Tokenizer(tiny_llama_dir).chat_template
    want = base_template if trained == "chat_template" else STYLE_TEMPLATES[trained]
    merged = json.loads((out / "final" / "merged" / "tokenizer_config.json").read_text())
    assert merged["chat_template"] == want
    assert Tokenizer(out / "final" / "merged").encode_chat([{"role": "user", "content": QUESTION}]) == training
    reader = gguf.GGUFReader(out / "final" / "model-f32.gguf")
    field = reader.fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == want


def test_the_style_registry_names_each_rendering_class_and_the_cli_choices():
    import typing

    from lit_qlora.train.args import DataArgs

    assert list(PROMPT_STYLES) == list(STYLES)  # a style is an entry in templates.STYLES and its class in prompts
    assert typing.get_args(typing.get_type_hints(DataArgs)["prompt_style"]) == ("auto", *STYLES)
    assert set(STYLE_TEMPLATES) == {name for name, template in STYLES.items() if template}
