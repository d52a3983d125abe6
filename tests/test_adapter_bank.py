"""Many adapters on one base (lit_qlora.lora.bank): rows of one batch each decode with their own adapter, exactly as
that fine-tune loaded alone answers (fp32 logits, greedy and seeded tokens), on a plain and an NF4 base; unloading
keeps rows in flight whole and frees the slot after them."""

import pytest
import torch

from helpers import random_adapter
from lit_qlora.checkpoint.adapter import read_adapter_factors
from lit_qlora.checkpoint.loading import load_model
from lit_qlora.lora.bank import AdapterBank, BankedLinear
from lit_qlora.model.batch_decode import DecodeBatch, Row
from lit_qlora.model.sampling import generate

ADAPTERS = {"support": (["all"], 4, 8.0), "legal": (["q", "v", "down"], 8, 16.0)}


@pytest.fixture(scope="module", params=["none", "nf4"])
def setup(request, tiny_llama_dir, tmp_path_factory):
    quantize = request.param
    folder = tmp_path_factory.mktemp(f"bank-{quantize}")
    dirs = {}
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        model = load_model(tiny_llama_dir, quantize, "32-true")
        dirs[name] = random_adapter(model, folder / name, quantize, targets, r, alpha)
    alone = {name: load_model(tiny_llama_dir, quantize, "32-true", d) for name, d in dirs.items()}
    alone["base"] = load_model(tiny_llama_dir, quantize, "32-true")
    base = load_model(tiny_llama_dir, quantize, "32-true")
    bank = AdapterBank(base)
    slots = {"base": 0}
    for name, d in dirs.items():
        _, factors, scale = read_adapter_factors(d)
        slots[name] = bank.add(name, factors, scale)
    return base, bank, slots, alone


def test_each_row_of_one_forward_computes_its_own_adapter(setup):
    base, bank, slots, alone = setup
    idx = torch.tensor([[5, 17, 99, 3, 42, 7], [8, 8, 1, 2, 3, 4], [60, 61, 62, 63, 64, 65], [9, 19, 29, 39, 49, 59]])
    names = ["support", "legal", "base", "support"]
    bank.select([slots[n] for n in names])
    with torch.inference_mode():
        got = base(idx)
        for i, name in enumerate(names):
            torch.testing.assert_close(got[i], alone[name](idx[i : i + 1])[0], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(alone["support"](idx[:1]), alone["legal"](idx[:1]), atol=1e-3)
        assert not torch.allclose(alone["support"](idx[:1]), alone["base"](idx[:1]), atol=1e-3)
    assert sum(isinstance(m, BankedLinear) for m in base.modules()) == len(bank.layers) > 0


def test_batched_rows_with_different_adapters_answer_as_each_fine_tune_alone(setup):
    base, bank, slots, alone = setup
    prompts = {"a": ([1, 2, 3, 4, 5], "support", 0.0), "b": ([9, 8, 7], "legal", 0.0), "c": ([50, 51], "base", 0.0),
               "d": ([1, 2, 3, 4, 5], "legal", 1.0), "e": ([33] * 9, "support", 0.8)}
    batch = DecodeBatch(base, before_forward=lambda rows: bank.select([r.adapter for r in rows]))
    got = {}
    for key, (prompt, name, temperature) in prompts.items():
        batch.add(Row(key, prompt, 24, temperature=temperature, seed=len(key) + ord(key), adapter=slots[name]))
        got[key] = []
    while batch.rows:
        for t in batch.step():
            if t.token is not None:
                got[t.key].append(t.token)
    for key, (prompt, name, temperature) in prompts.items():
        assert got[key] == list(generate(alone[name], prompt, 24, temperature, seed=len(key) + ord(key))), key
    assert got["a"] != got["d"]


def test_an_adapter_unloaded_mid_reply_stays_until_its_rows_end(setup, tiny_llama_dir, tmp_path):
    base, bank, slots, alone = setup
    torch.manual_seed(99)
    extra = random_adapter(load_model(tiny_llama_dir, "none", "32-true"), tmp_path / "extra", "none", ["o"], 2, 4.0)
    _, factors, scale = read_adapter_factors(extra)
    slot = bank.add("extra", factors, scale)
    assert slot == 3 and bank.size == 4
    layer = bank.layers["model.layers.0.self_attn.o_proj"]
    bank.remove("extra", in_use=[slot])
    assert slot in bank.retiring and layer.ranks.get(slot) == 2  # a row in flight still decodes with it
    bank.select([0, 1])
    assert slot not in bank.retiring and slot not in layer.ranks and not layer.A[slot].any()
    assert bank.add("extra", factors, scale) == slot  # the freed slot is reused
    bank.remove("extra")
    assert "extra" not in bank.names and not layer.A[slot].any()
    with pytest.raises(ValueError, match="loaded already"):
        bank.add("support", {}, 1.0)
