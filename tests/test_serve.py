"""`litqlora serve` (lit_qlora/deploy/serve.py), called as apps call it: the official `openai` client, streaming and
not, gets what `litqlora generate` answers at temperature 0; concurrent clients get their own answers; a wrong key
gets 401 and a malformed body 422, and the server goes on serving."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("litserve")
KEY = "test-key"
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lit_qlora.cli", "serve", "--checkpoint_dir", str(smollm2_dir),
                             "--port", str(port), "--api_key", KEY, "--precision", "32-true"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200 and r.read() == b"ok":
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the server did not come up:\n{proc.stdout.read()[-3000:]}")
        time.sleep(1)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def expected(smollm2_dir):
    """`litqlora generate`'s replies at temperature 0 (the same chat template, 32 tokens at most)."""
    from lit_qlora.deploy.generate import generate_command

    return {q: generate_command(q, checkpoint_dir=smollm2_dir, max_new_tokens=32, precision="32-true")
            for q in QUESTIONS}


def client(url, key=KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def ask(url, question, stream=False):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=32)
    if not stream:
        return client(url).chat.completions.create(**kwargs).choices[0].message.content
    chunks = client(url).chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks)


def test_the_openai_client_gets_generates_answer_streamed_and_not(server, expected, smollm2_dir):
    q = QUESTIONS[0]
    assert ask(server, q).strip() == expected[q].strip() and "Paris" in expected[q]
    assert ask(server, q, stream=True).strip() == expected[q].strip()
    models = client(server).models.list()
    assert [m.id for m in models.data] == [smollm2_dir.name]


def test_concurrent_clients_get_their_own_answers(server, expected):
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: ask(server, q, stream=q != QUESTIONS[0]), QUESTIONS))
    assert [a.strip() for a in answers] == [expected[q].strip() for q in QUESTIONS]


def test_a_wrong_key_gets_401_and_a_malformed_body_422_and_serving_goes_on(server, expected):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    request = urllib.request.Request(f"{server}/v1/chat/completions", data=json.dumps({"messages": "hi"}).encode(),
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(request, timeout=30)
    assert bad.value.code == 422 and "messages" in bad.value.read().decode()
    assert ask(server, QUESTIONS[0]).strip() == expected[QUESTIONS[0]].strip()


def test_a_bad_checkpoint_or_adapter_is_a_one_line_error_before_serving(tmp_path):
    for args in (["--checkpoint_dir", str(tmp_path / "missing")], ["--adapter_dir", str(tmp_path / "missing")]):
        done = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "serve", *args, "--port", str(free_port())],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert str(tmp_path / "missing") in done.stderr
