"""generate's prefill: the head over the prompt's last position only, the model's own call where hooks wrap it."""

import torch

from lit_qlora.model.config import Config
from lit_qlora.model.sampling import generate, last_logits
from lit_qlora.model.transformer import Transformer


def tiny_model():
    torch.manual_seed(0)
    model = Transformer(Config(vocab_size=96, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128,
                               max_seq_length=32, tie_embeddings=False))
    model.init_weights(std=0.1)
    return model.eval()


def test_prefill_runs_the_head_on_the_last_position_only():
    model = tiny_model()
    idx, pos = torch.tensor([[3, 9, 27, 81, 5]]), torch.arange(5)
    head_rows = []
    model.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[1]))
    with torch.inference_mode():
        full = model(idx)[0, -1]
        head_rows.clear()
        model.set_kv_cache(1, 8)
        got = last_logits(model, idx, pos)
        model.clear_kv_cache()
    assert head_rows == [1]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert len(list(generate(model, [3, 9, 27, 81, 5], 6))) == 6
    assert head_rows[1:] == [1] * 6  # the prefill and every decode step: one position each


def test_a_hooked_model_is_called_as_a_whole():
    model = tiny_model()
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))  # as FSDP2 unshards its root parameters
    with torch.inference_mode():
        model.set_kv_cache(1, 8)
        last_logits(model, torch.tensor([[3, 9, 27]]), torch.arange(3))
        model.clear_kv_cache()
    assert calls == [1]
