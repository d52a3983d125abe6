"""`litqlora generate`, `chat` and `serve` on a mixture of experts (issue 54 item 6): an NF4 base (every expert's
projections stacked in NF4, the router in full precision) with a LoRA adapter on attention, every expert and the
router, decoded with the KV cache one token at a time through the router (gpt-oss: its sinks and sliding windows of
4 tokens, shorter than the prompt). Greedy replies equal decoding without the cache (the whole sequence at each step,
no decode kernel) and transformers' greedy generate on the merged model; the adapter changes them; chat answers
turns as generation from scratch over the whole conversation; serve answers /v1/chat/completions with them.

Tiny random checkpoints that transformers writes, with SmolLM2's real tokenizer and chat template, in fp32 (32-true):
greedy tokens are exact there, where bf16's roundings can flip a near tie between the two paths."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_qlora.checkpoint.loading import load_model  # noqa: E402
from lit_qlora.data.inference import trained_tokenizer  # noqa: E402
from lit_qlora.model.sampling import generate  # noqa: E402

from helpers import free_port, random_adapter, wait_until_serving, write_tiny_moe  # noqa: E402

QUESTION = "What is the capital of France?"
NEW_TOKENS = 12
TARGETS = ["all", "router"]  # attention, every expert, and the router (routing changes too)


@pytest.fixture(scope="module")
def mixture(smollm2_dir, tmp_path_factory):
    """model_type -> (checkpoint, adapter): written once per family and module."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(model_type: str) -> tuple[Path, Path]:
        if model_type not in made:
            root = tmp_path_factory.mktemp(model_type)
            write_tiny_moe(model_type, root / "hf", vocab_size=49152, tokenizer_dir=smollm2_dir)
            model = load_model(root / "hf", "nf4", "32-true")
            made[model_type] = root / "hf", random_adapter(model, root / "adapter", "nf4", TARGETS)
        return made[model_type]

    return make


def greedy_without_cache(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding that recomputes the whole sequence at every step (no KV cache, no decode kernel)."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


def merged_fp32(model, out: Path) -> Path:
    """The adapter merged into dequant(NF4(W)) as `litqlora merge` writes it, in fp32 (merge's files are bf16)."""
    from lit_qlora.checkpoint.hf import save_hf_checkpoint
    from lit_qlora.export.hf import export_config, hf_tensor_specs

    return save_hf_checkpoint(out, export_config(model, True), hf_tensor_specs(model, torch.float32, merge=True),
                              dtype=torch.float32)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "mixtral", "olmoe"])
def test_generate_with_the_kv_cache_equals_no_cache_and_transformers_on_the_merged_model(model_type, mixture,
                                                                                         tmp_path, capsys):
    from lit_qlora.deploy.generate import generate_command
    from lit_qlora.lora.experts import LoRAExpertLinear

    path, adapter = mixture(model_type)
    said = generate_command(prompt=QUESTION, checkpoint_dir=path, adapter_dir=adapter, precision="32-true",
                            max_new_tokens=NEW_TOKENS, compare_base=True)
    base_part, _, tuned_part = capsys.readouterr().out.partition(f"fine-tuned (with the adapter from {adapter}):\n  ")
    assert base_part.startswith("base model (NF4, without the adapter):\n  ") and tuned_part == said + "\n"
    base_said = base_part.removeprefix("base model (NF4, without the adapter):\n  ").removesuffix("\n")

    model = load_model(path, adapter_dir=adapter, precision="32-true")  # NF4, as the adapter trained
    assert sum(isinstance(m, LoRAExpertLinear) for m in model.modules()) == 2 * 3
    tok = trained_tokenizer(path, adapter)
    ids = tok.encode_prompt(QUESTION)
    if model_type == "gpt_oss":
        assert len(ids) > 4 * model.config.sliding_window  # its sliding layers decode past their window
    cached = list(generate(model, ids, NEW_TOKENS))
    assert len(cached) == NEW_TOKENS
    assert cached == greedy_without_cache(model, ids, NEW_TOKENS)
    assert said == tok.decode(cached)  # what `litqlora generate` printed (no end-of-sequence token among them)
    assert base_said != said  # the adapter changed the answer

    reference = transformers.AutoModelForCausalLM.from_pretrained(merged_fp32(model, tmp_path / "merged"),
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert theirs == cached


def test_chat_turns_on_a_mixture_equal_generation_over_the_whole_conversation(mixture, monkeypatch, capsys):
    """`litqlora chat` (greedy) on the NF4 Qwen3-MoE with its adapter: the second turn reuses the first turn's KV
    cache and feeds only what is new, and each printed reply equals a fresh reply to the conversation so far."""
    from lit_qlora.deploy.chat import chat_command

    path, adapter = mixture("qwen3_moe")
    questions = [QUESTION, "And the capital of Italy?"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(questions) + "\n/exit\n"))
    handler = signal.getsignal(signal.SIGINT)
    try:
        chat_command(checkpoint_dir=path, adapter_dir=adapter, precision="32-true", temperature=0.0,
                     max_new_tokens=NEW_TOKENS)
    finally:
        signal.signal(signal.SIGINT, handler)  # (chat installs its own)
    out = capsys.readouterr().out
    header, _, replies = out.partition("\n")
    assert header.startswith(f"Chatting with {path} + {adapter}")

    model, tok = load_model(path, adapter_dir=adapter, precision="32-true"), trained_tokenizer(path, adapter)
    messages, expected = [], ""
    for question in questions:
        messages.append({"role": "user", "content": question})
        reply = tok.decode(list(generate(model, tok.encode_chat(messages), NEW_TOKENS, stop_ids=tok.eos_ids)))
        messages.append({"role": "assistant", "content": reply.strip()})
        expected += reply + "\n"
    assert replies == expected


def stop(proc: subprocess.Popen, signum: int) -> None:
    """Stop the server's process group (LitServe's workers with it), at once after 30 s."""
    for sig in (signum, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            pass


def test_serve_answers_chat_completions_on_a_mixture_as_generate_does(mixture):
    """`litqlora serve` of the NF4 gpt-oss with its adapter (a server process, as users run it): a greedy
    /v1/chat/completions request, streamed and not, gets generate's reply and its token counts."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("litserve")
    path, adapter = mixture("gpt_oss")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lit_qlora.cli", "serve", "--checkpoint_dir", str(path),
                             "--adapter_dir", str(adapter), "--precision", "32-true", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # the reply to expect, while the server starts
        model, tok = load_model(path, adapter_dir=adapter, precision="32-true"), trained_tokenizer(path, adapter)
        prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
        reply = list(generate(model, prompt, NEW_TOKENS, stop_ids=tok.eos_ids))
        del model
        wait_until_serving(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        ask = dict(model="gpt-oss", messages=[{"role": "user", "content": QUESTION}], temperature=0,
                   max_tokens=NEW_TOKENS)
        answer = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(stream=True, **ask))
    finally:
        stop(proc, signal.SIGTERM)
    assert answer.choices[0].message.content == tok.decode(reply)
    assert answer.choices[0].finish_reason == ("length" if len(reply) == NEW_TOKENS else "stop")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), len(reply))
    assert answer.model == adapter.name
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tok.decode(reply)


def test_download_keeps_gpt_oss_chat_template_and_skips_its_original_weights(monkeypatch, tmp_path):
    """`litqlora download openai/gpt-oss-20b`: its chat template is in chat_template.jinja (tokenizer_config.json has
    none; chat and serve need it) and its original/ folder holds a second copy of the weights for OpenAI's own code:
    the filter keeps the first and skips the second (the Hub's own filtering, on the repository's kinds of files)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from lit_qlora.checkpoint.download import download

    listing = ["config.json", "generation_config.json", "model.safetensors.index.json",
               "model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors", "chat_template.jinja",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "original/config.json",
               "original/dtypes.json", "original/model.safetensors", "metal/model.bin", "LICENSE", "README.md"]

    def snapshot_download(repo_id, local_dir, allow_patterns=None, ignore_patterns=None, **kwargs):
        for name in filter_repo_objects(listing, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (Path(local_dir) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(local_dir) / name).write_text("")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    out = download("openai/gpt-oss-20b", tmp_path / "gpt-oss-20b")
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(n for n in listing if not n.startswith(("original/", "metal/"))
                         and n not in ("LICENSE", "README.md"))
