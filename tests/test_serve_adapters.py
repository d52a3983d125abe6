"""`litqlora serve --adapters`: many fine-tunes on one base, chosen per request by `model`. Each answers exactly as
that fine-tune served alone (greedy), also as rows of one batch with another adapter; /v1/models lists them;
/v1/load_lora_adapter and /v1/unload_lora_adapter change them while serving; bad names and paths are error objects."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("litserve")

from helpers import free_port, wait_until_serving  # noqa: E402

KEY = "k"
QUESTION = "Say something."
ADAPTERS = {"support": (["all"], 4, 8.0), "legal": (["q", "v", "down"], 8, 16.0), "extra": (["o", "up"], 2, 4.0)}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    import torch

    from lit_qlora.checkpoint.loading import load_model

    from lit_qlora.checkpoint.adapter import save_adapter
    from lit_qlora.lora.layer import apply_lora, lora_modules

    folder = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        model = load_model(tiny_llama_dir, "none", "32-true")
        apply_lora(model, r=r, alpha=alpha, dtype=torch.float32, targets=targets)
        generator = torch.Generator().manual_seed(20 + i)
        with torch.no_grad():  # large enough to change the tiny random model's greedy replies
            for layer in lora_modules(model).values():
                layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=generator))
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.3)
        dirs[name] = save_adapter(model, folder / name, {"r": r, "alpha": alpha, "targets": targets, "quantize": "none",
                                                         "base_dtype": "float32", "lora_dtype": "float32"})
    return dirs


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, adapters):
    """Each fine-tune's greedy reply to QUESTION, loaded alone (and the base's): what the server must answer."""
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.model.sampling import generate

    tok = Tokenizer(tiny_llama_dir)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    replies = {}
    for name, folder in [("base", None), *adapters.items()]:
        model = load_model(tiny_llama_dir, "none", "32-true", folder)
        replies[name] = {n: tok.decode(list(generate(model, prompt, n, stop_ids=tok.eos_ids))) for n in (12, 200)}
    assert len({r[12] for r in replies.values()}) == len(replies)  # every adapter changes the reply
    return replies


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    port = free_port()
    listed = f"[support={adapters['support']}, legal={adapters['legal']}]"
    proc = subprocess.Popen([sys.executable, "-m", "lit_qlora.cli", "serve", "--checkpoint_dir", str(tiny_llama_dir),
                             "--adapters", listed, "--port", str(port), "--api_key", KEY, "--precision", "32-true",
                             "--model_name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url, proc)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(url, model, max_tokens=12, **kwargs):
    return client(url).chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                               temperature=0, max_tokens=max_tokens, **kwargs)


def post(url, route, body, key=KEY):
    request = urllib.request.Request(f"{url}/v1/{route}", json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_each_request_answers_with_the_adapter_its_model_names(server, alone):
    for model, name in [("support", "support"), ("legal", "legal"), ("tiny", "base")]:
        reply = ask(server, model)
        assert reply.choices[0].message.content == alone[name][12], model
        assert reply.model == model
    assert [m.id for m in client(server).models.list().data] == ["tiny", "support", "legal"]
    with pytest.raises(openai.NotFoundError) as missing:
        ask(server, "suport")  # a typo is an error, not the base answering in the adapter's place
    assert missing.value.body["code"] == "model_not_found" and "'support'" in missing.value.body["message"]


def test_rows_of_one_batch_with_different_adapters_answer_as_each_alone(server, alone):
    """A long `support` stream is decoding when `legal` and base requests join its batch: each is exact."""
    flowing, pieces = threading.Event(), []

    def long_stream():
        for chunk in ask(server, "support", max_tokens=200, stream=True):
            pieces.append(chunk.choices[0].delta.content or "")
            if len(pieces) == 2:
                flowing.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    assert flowing.wait(60)
    joined = [ask(server, "legal"), ask(server, "tiny", n=2)]
    reader.join(120)
    assert "".join(pieces) == alone["support"][200]
    assert joined[0].choices[0].message.content == alone["legal"][12]
    assert [c.message.content for c in joined[1].choices] == [alone["base"][12]] * 2


def test_adapters_load_and_unload_while_serving(server, alone, adapters, tmp_path):
    assert post(server, "load_lora_adapter", {"lora_name": "extra", "lora_path": str(adapters["extra"])}) == (
        200, "Success: LoRA adapter 'extra' added successfully.")
    assert [m.id for m in client(server).models.list().data] == ["tiny", "support", "legal", "extra"]
    assert ask(server, "extra").choices[0].message.content == alone["extra"][12]
    status, error = post(server, "load_lora_adapter", {"lora_name": "extra", "lora_path": str(adapters["legal"])})
    assert status == 400 and "taken" in error["error"]["message"]
    status, error = post(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")})
    assert status == 400 and str(tmp_path / "missing") in error["error"]["message"]
    assert error["error"]["param"] == "lora_path"
    assert post(server, "unload_lora_adapter", {"lora_name": "extra"})[0] == 200
    assert [m.id for m in client(server).models.list().data] == ["tiny", "support", "legal"]
    with pytest.raises(openai.NotFoundError):
        ask(server, "extra")
    status, error = post(server, "unload_lora_adapter", {"lora_name": "extra"})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, error = post(server, "load_lora_adapter", {"lora_name": "y", "lora_path": str(adapters["extra"])}, "bad")
    assert status == 401
    assert ask(server, "support").choices[0].message.content == alone["support"][12]  # the others as they were


def test_bad_adapter_flags_are_one_paragraph_errors_before_serving(tiny_llama_dir, adapters, tmp_path):
    cases = [("[support]", "NAME=DIR", []), (f"[a={adapters['support']}, a={adapters['legal']}]", "twice", []),
             (f"[a={tmp_path / 'none'}]", str(tmp_path / "none"), []),
             (f"[a={adapters['support']}]", "--adapter_dir", ["--adapter_dir", str(adapters["legal"])])]
    for listed, expected, extra in cases:
        done = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "serve", "--checkpoint_dir", str(tiny_llama_dir),
                               "--adapters", listed, *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert expected in done.stderr and "--adapters" in done.stderr, done.stderr
