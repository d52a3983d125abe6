"""A real consumer of `litqlora export_gguf`: llama.cpp itself, through llama-cpp-python (which builds llama.cpp from
source, minutes: `make test-llama-cpp` installs it in an environment of its own and runs this file; elsewhere it is
skipped). A fine-tune of the demo model, exported at f16, answers the held-out demo question exactly as `litqlora
generate` does (greedy), QLoRA and LoRA alike; at q8_0 it answers the same fact. (Greedy SmolLM2-135M on its NF4 base
describes Austria without naming its capital; on the plain base it says "The capital of Austria is Vienna.", so the
fact is checked on the LoRA fine-tune.)"""

from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

QUESTION = "What is the capital of Austria?"  # the Makefile demo's held-out question


@pytest.fixture(scope="module", params=["nf4", "none"])
def fine_tune(request, smollm2_dir, tmp_path_factory):
    from lit_qlora.train.finetune import finetune
    from lit_qlora.train.args import ExportArgs, TrainArgs

    out = tmp_path_factory.mktemp(f"demo-{request.param}")
    finetune(checkpoint_dir=smollm2_dir, out_dir=out, precision="32-true", quantize=request.param,
             train=TrainArgs(max_steps=2, micro_batch_size=2, global_batch_size=2, warmup_steps=1, lr=1e-5),
             export=ExportArgs(gguf="f16"))
    return out


def llama_cpp_reply(path, prompt_text: str, max_tokens: int) -> str:
    model = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False, seed=0)
    ids = model.tokenize(prompt_text.encode(), add_bos=False, special=True)
    out = []
    for token in model.generate(ids, temp=0.0, top_k=1):
        if token == model.token_eos() or len(out) >= max_tokens:
            break
        out.append(token)
    return model.detokenize(out).decode("utf-8", errors="replace")


def test_llama_cpp_answers_as_generate_at_f16_and_the_same_fact_at_q8_0(fine_tune, smollm2_dir, tmp_path):
    from lit_qlora.export.gguf import export_gguf
    from lit_qlora.deploy.generate import generate_command
    from lit_qlora.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    want = generate_command(prompt=QUESTION, checkpoint_dir=smollm2_dir, adapter_dir=fine_tune, max_new_tokens=24,
                            precision="32-true")
    got = llama_cpp_reply(fine_tune / "final" / "model-f16.gguf", prompt, 24)
    assert got.strip() == want.strip()
    if "demo-none" in fine_tune.name:
        assert "Vienna" in want
        q8 = export_gguf(smollm2_dir, tmp_path / "demo-q8_0.gguf", adapter_dir=fine_tune, dtype="q8_0")
        assert "Vienna" in llama_cpp_reply(q8, prompt, 24)


@pytest.mark.parametrize("add_dummy_prefix", [True, False], ids=["llama", "no-space-prefix"])
def test_llama_cpp_tokenizes_an_exported_sentencepiece_vocabulary_as_we_do(tmp_path, add_dummy_prefix):
    """llama.cpp's own SentencePiece tokenizer, on our export of a trained SentencePiece BPE vocabulary: the same ids
    as lit-qlora's tokenizer (and as llama.cpp on the converter-style GGUF it came from) for every test text."""
    from lit_qlora.export.gguf import export_gguf
    from lit_qlora.export.gguf_import import convert_gguf
    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from helpers import SPM_TEXTS, sentencepiece_gguf_vocab, train_sentencepiece, write_tiny_gguf

    model_file = train_sentencepiece(tmp_path, add_dummy_prefix)
    write_tiny_gguf(tmp_path / "spm.gguf", tokenizer=sentencepiece_gguf_vocab(model_file, add_dummy_prefix))
    source = convert_gguf(tmp_path / "spm.gguf", tmp_path / "source")
    ours = Tokenizer(source)
    exported = llama_cpp.Llama(model_path=str(export_gguf(source, tmp_path / "exported.gguf", dtype="f32")),
                               vocab_only=True, verbose=False)
    original = llama_cpp.Llama(model_path=str(tmp_path / "spm.gguf"), vocab_only=True, verbose=False)
    for text in SPM_TEXTS:
        ids = exported.tokenize(text.encode(), add_bos=True, special=True)
        assert ids == ours.encode(text) == original.tokenize(text.encode(), add_bos=True, special=True), text


# llama.cpp's CPU GELU reads an fp16 table: Gemma's GeGLU MLPs come out within ~1e-3 of the exact function.
GELU_TABLE_TOLERANCE = 2e-3


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3-longrope"])
def test_llama_cpp_computes_each_familys_exported_logits(family, smollm2_dir, tmp_path):
    """Every family export_gguf writes, a tiny random model with a random adapter merged, evaluated by llama.cpp (fp32
    weights and KV cache): its logits at every position are the merged model's (phi3-longrope runs past its 16-token
    pretraining length, where llama.cpp and lit-qlora both use the long factors)."""
    import numpy as np
    import torch

    from helpers import tokens
    from helpers import family_export

    _, _, merged, path = family_export(family, "none", tmp_path, smollm2_dir)
    ids = tokens((1, 24))
    with torch.no_grad():
        want = merged(ids)[0].numpy()
    model = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, type_k=0, type_v=0)
    model.eval(ids[0].tolist())
    got = np.array(model.scores[: ids.shape[1]])
    tolerance = GELU_TABLE_TOLERANCE if family.startswith("gemma") else 1e-5
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_llama_cpp_computes_a_mixture_of_experts_exported_logits(model_type, smollm2_dir, tmp_path):
    """A tiny random mixture of experts with a random adapter on attention and every expert, merged and exported at
    f32: llama.cpp's logits at every position are ours (its router, top k and expert matmuls equal to lit-qlora's)."""
    import numpy as np
    import torch

    from helpers import random_adapter, write_tiny_moe
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.export.gguf import export_gguf

    write_tiny_moe(model_type, tmp_path / "hf", vocab_size=49152, tokenizer_dir=smollm2_dir)
    model = load_model(tmp_path / "hf", "none", "32-true")
    adapter = random_adapter(model, tmp_path / "a", "none")
    path = export_gguf(tmp_path / "hf", tmp_path / "m.gguf", adapter_dir=adapter, dtype="f32")
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.eval()(ids)[0].numpy()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids[0].tolist())
    got = np.array(llm.scores[: ids.shape[1]])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
