"""`litqlora chat` (lit_qlora/deploy/chat.py): later turns see the earlier ones (the whole conversation through
the chat template) while the KV cache spares recomputing them, /reset forgets, replies equal plain generation; Ctrl-C
stops a reply (kept as far as it was shown), the next turn answers as if computed from scratch, and Ctrl-C at the
prompt leaves (checked in a pseudo-terminal)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest
import torch

from lit_qlora.deploy.chat import ChatSession
from lit_qlora.checkpoint.loading import load_model
from lit_qlora.model.sampling import generate, sample
from lit_qlora.checkpoint.tokenizer import Tokenizer


def fresh_reply(model, tok, messages, max_new_tokens):
    """The greedy reply to `messages` from scratch (no cache carried over): what each chat turn must equal."""
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), bos=False)
    return tok.decode(list(generate(model, ids, max_new_tokens, stop_ids=tok.eos_ids)))


def say(session, text, n=24):
    return "".join(session.reply(text, max_new_tokens=n))


def test_turns_reuse_the_cache_and_equal_generation_over_the_whole_conversation(tiny_llama_dir):
    model, tok = load_model(tiny_llama_dir, "nf4", "32-true"), Tokenizer(tiny_llama_dir)
    fed = []
    forward = model.forward
    model.forward = lambda idx, input_pos=None: fed.append(idx.shape[1]) or forward(idx, input_pos)
    session = ChatSession(model, tok, system="You are terse.")
    first = say(session, "Hello there")
    prompt1 = len(tok.encode(tok.apply_chat_template(session.messages[:2], add_generation_prompt=True), bos=False))
    assert fed[0] == prompt1  # the first turn computes its whole prompt, then one token at a time
    fed.clear()
    second = say(session, "And again")
    messages = session.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    full = len(tok.encode(tok.apply_chat_template(messages[:4], add_generation_prompt=True), bos=False))
    assert fed[0] < full - prompt1 + 8  # only what is new: the last reply's end and the new user turn
    model.forward = forward
    assert first.strip() == fresh_reply(model, tok, messages[:2], 24).strip() == messages[2]["content"]
    assert second.strip() == fresh_reply(model, tok, messages[:4], 24).strip()
    session.reset()
    assert session.messages == [{"role": "system", "content": "You are terse."}] and session.fed == []
    assert say(session, "And again").strip() == fresh_reply(model, tok, session.messages[:2], 24).strip()


def test_a_conversation_past_the_context_is_refused_and_reset_recovers(tiny_llama_dir):
    model, tok = load_model(tiny_llama_dir, "none", "32-true"), Tokenizer(tiny_llama_dir)
    session = ChatSession(model, tok)
    with pytest.raises(ValueError, match="/reset starts a new one"):
        say(session, "word " * (model.config.max_seq_length + 10))
    assert session.messages == []
    assert isinstance(say(session, "hi"), str)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([3.0, 2.0, 1.0, -5.0])
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, None, gen, top_p=0.1) for _ in range(50)} == {0}  # the most likely alone
    probs = torch.softmax(logits, 0)
    drawn = {sample(logits, 1.0, None, gen, top_p=float(probs[:2].sum()) - 1e-3) for _ in range(200)}
    assert drawn == {0, 1}


def test_smollm2_remembers_the_first_turn_and_forgets_it_after_reset(smollm2_dir):
    model, tok = load_model(smollm2_dir, "none", "32-true"), Tokenizer(smollm2_dir)
    session = ChatSession(model, tok)
    say(session, "Hi, my name is Ada.", 32)
    with_history = say(session, "What is my name?", 32)
    alone = fresh_reply(model, tok, [{"role": "user", "content": "What is my name?"}], 32)
    assert with_history.strip() == fresh_reply(model, tok, session.messages[:3], 32).strip()
    assert with_history.strip() != alone.strip()  # the first turn changed the answer
    session.reset()
    assert say(session, "What is my name?", 32).strip() == alone.strip()


@pytest.mark.parametrize("leave", ["/quit", "/exit"])
def test_cli_session_runs_a_script_from_stdin(tiny_llama_dir, leave):
    script = f"Hello\n/reset\n\n/help\nHello again\n{leave}\nnever read\n"
    done = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "chat", "--checkpoint_dir", str(tiny_llama_dir),
                           "--temperature", "0", "--max_new_tokens", "8"], input=script, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Chatting with")
    assert all(command in lines[0] for command in ("/reset", "/exit or /quit", "Ctrl-D", "/help"))  # the banner names all
    assert "(new conversation)" in lines
    assert lines.count(f"({lines[0].split(': ', 1)[1].rstrip('.')})") == 1  # /help repeats them (and is no message)
    no_template = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "chat", "--checkpoint_dir", "/nonexistent"],
                                 input="hi\n", capture_output=True, text=True, timeout=300)
    assert no_template.returncode != 0 and "/nonexistent" in no_template.stderr


class StopAfter:
    """Wraps a model's forward: the `calls`-th call raises KeyboardInterrupt before computing (Ctrl-C in the model)."""

    def __init__(self, model, calls):
        self.model, self.forward, self.calls = model, model.forward, calls
        model.forward = self

    def __call__(self, idx, input_pos=None):
        self.calls -= 1
        if self.calls == 0:
            self.model.forward = self.forward
            raise KeyboardInterrupt
        return self.forward(idx, input_pos)


def test_a_stopped_reply_stays_as_far_as_it_was_shown_and_the_next_turns_are_exact(tiny_llama_dir):
    model, tok = load_model(tiny_llama_dir, "none", "32-true"), Tokenizer(tiny_llama_dir)
    session = ChatSession(model, tok)
    turns = []  # (the conversation a greedy reply answered, that reply): compared with fresh replies at the end

    def greedy(text):
        reply = say(session, text)
        turns.append((session.messages[:-1], reply))

    story = "Tell me a story"
    prompt = tok.encode_chat([{"role": "user", "content": story}])
    StopAfter(model, 9)  # the prompt, then 7 tokens fed back; the 8th token's forward is interrupted
    shown = []
    with pytest.raises(KeyboardInterrupt):
        for piece in session.reply(story, max_new_tokens=40, temperature=1.0):  # sampled: words, not blank lines
            shown.append(piece)
    said = "".join(shown).strip()
    assert said and session.messages == [{"role": "user", "content": story}, {"role": "assistant", "content": said}]
    assert session.fed[:len(prompt)] == prompt and len(session.fed) == len(prompt) + 7  # the cache trusted so far
    greedy("And again")  # from the cache the stopped turn left

    # The caller stops reading (Ctrl-C while printing): closing the reply records what it had handed out
    reply = session.reply("Go on", max_new_tokens=40, temperature=1.0)
    pieces = [next(reply) for _ in range(12)]
    reply.close()
    assert "".join(pieces).strip() and session.messages[-2:] == [
        {"role": "user", "content": "Go on"}, {"role": "assistant", "content": "".join(pieces).strip()}]
    greedy("Why?")

    # Stopped before anything was shown (in the prompt's forward): no turn at all
    before = list(session.messages)
    StopAfter(model, 1)
    with pytest.raises(KeyboardInterrupt):
        say(session, "A question never answered")
    assert session.messages == before
    greedy("Last one")

    # Each reply is what its whole conversation gives from scratch (generate replaces the chat's cache: last)
    assert [len(messages) for messages, _ in turns] == [3, 7, 9]
    for messages, reply in turns:
        assert reply.strip() == fresh_reply(model, tok, messages, 24).strip()


def read_until(fd, out, done, timeout=300, drain=False):
    """Read the terminal's output into `out` (a bytearray) until `done(text)` holds (or, to `drain`, until the other
    side closes or `timeout` passes); the text read so far."""
    deadline = time.monotonic() + timeout
    while not done(out.decode(errors="replace")):
        if time.monotonic() > deadline:
            if drain:
                break
            raise AssertionError(f"timed out; the terminal shows:\n{out.decode(errors='replace')[-3000:]}")
        if select.select([fd], [], [], 1)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:  # EIO: the other side closed
                break
    return out.decode(errors="replace")


def test_ctrl_c_in_a_terminal_stops_the_reply_and_a_second_at_the_prompt_leaves(smollm2_dir):
    """The real model in a pseudo-terminal, as a user types: a question, Ctrl-C (the terminal's ^C, which the line
    discipline turns into SIGINT) once the reply streams, the prompt back, a next question answered from the
    conversation with the stopped reply in it, Ctrl-C at the prompt: exit status 0."""
    import pty

    master, slave = pty.openpty()
    # A new session whose controlling terminal is the pty, so ^C there interrupts the chat as it would a user's
    launcher = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                "os.execv(sys.executable, [sys.executable, '-m', 'lit_qlora.cli', *sys.argv[1:]])")
    proc = subprocess.Popen([sys.executable, "-c", launcher, "chat", "--checkpoint_dir", str(smollm2_dir),
                             "--temperature", "0", "--max_new_tokens", "300", "--precision", "32-true"],
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True, close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        screen = read_until(master, out, lambda t: "Chatting with" in t and t.endswith("> "))
        assert "Ctrl-C stops a reply" in screen
        story = "Tell me a long story about a dragon who learns to fly."
        os.write(master, story.encode() + b"\r")
        typed = story + "\r\n"  # the terminal's echo: the reply starts after it
        start = read_until(master, out, lambda t: typed in t).index(typed) + len(typed)
        read_until(master, out, lambda t: len(t[start:].strip()) >= 20)  # the reply is streaming
        os.write(master, b"\x03")
        screen = read_until(master, out, lambda t: "(stopped)" in t[start:] and t.endswith("> "))
        shown = screen[start:screen.index("(stopped)", start)].replace("^C", "").replace("\r\n", "\n").strip()
        assert len(shown) >= 20 and "Traceback" not in screen

        question = "What is the capital of France?"
        os.write(master, question.encode() + b"\r")
        typed = question + "\r\n"
        start = read_until(master, out, lambda t: typed in t[start:]).index(typed, start) + len(typed)
        screen = read_until(master, out, lambda t: t[start:].endswith("\r\n> "))
        second = screen[start:-len("\r\n> ")].replace("\r\n", "\n").strip()
        assert "Paris" in second
        os.write(master, b"\x03")
        assert proc.wait(timeout=60) == 0
        screen = read_until(master, out, lambda t: False, timeout=5, drain=True)
        assert "Traceback" not in screen and "interrupted" not in screen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)

    # The answer is what the whole conversation gives from scratch, the stopped reply in it as it was shown
    model, tok = load_model(smollm2_dir, "none", "32-true"), Tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": story}, {"role": "assistant", "content": shown},
                {"role": "user", "content": question}]
    assert second == fresh_reply(model, tok, messages, 300).strip()
