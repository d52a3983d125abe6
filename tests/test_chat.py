"""`litqlora chat` (lit_qlora/deploy/chat.py): later turns see the earlier ones (the whole conversation through
the chat template) while the KV cache spares recomputing them, /reset forgets, replies equal plain generation."""

from __future__ import annotations

import subprocess
import sys

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


def test_cli_session_runs_a_script_from_stdin(tiny_llama_dir):
    script = "Hello\n/reset\n\nHello again\n/quit\nnever read\n"
    done = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "chat", "--checkpoint_dir", str(tiny_llama_dir),
                           "--temperature", "0", "--max_new_tokens", "8"], input=script, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Chatting with") and "/reset" in lines[0]
    assert "(new conversation)" in lines
    no_template = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "chat", "--checkpoint_dir", "/nonexistent"],
                                 input="hi\n", capture_output=True, text=True, timeout=300)
    assert no_template.returncode != 0 and "/nonexistent" in no_template.stderr
