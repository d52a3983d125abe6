"""Streaming checkpoint loading (single, sharded, .bin) and Hugging Face export."""

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lit_qlora.lora import layer as lora
from lit_qlora.checkpoint.hf import load_checkpoint, save_hf_checkpoint
from lit_qlora.checkpoint.files import CheckpointError, TensorSpec, write_safetensors
from lit_qlora.export.hf import hf_tensor_specs
from lit_qlora.model.config import Config
from lit_qlora.lora.layer import apply_lora
from lit_qlora.model.transformer import Transformer
from lit_qlora.nf4 import quantize_linears

TINY = Config(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=48,
              max_seq_length=64)


def random_model(config=TINY, seed=0):
    torch.manual_seed(seed)
    model = Transformer(config)
    model.init_weights()
    return model


def write_hf_dir(path, model, shards=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_config(torch_dtype="float32")))
    sd = {k: v.clone() for k, v in model.state_dict().items()
          if not (model.config.tie_embeddings and k == "lm_head.weight")}
    if shards == 1:
        save_file(sd, str(path / "model.safetensors"))
        return path
    keys = list(sd)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i::shards]}
        save_file(part, str(path / name))
        weight_map.update({k: name for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_load_roundtrip(tmp_path, shards, tied):
    model = random_model(TINY.replace(tie_embeddings=tied))
    ckpt = write_hf_dir(tmp_path / "ckpt", model, shards)
    loaded = load_checkpoint(ckpt, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not any(p.is_meta for p in loaded.parameters())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    idx = torch.randint(0, 64, (1, 10))
    assert torch.equal(loaded(idx), model(idx))


def test_load_casts_dtype_and_transforms(tmp_path):
    ckpt = write_hf_dir(tmp_path / "ckpt", random_model())
    seen = []
    loaded = load_checkpoint(ckpt, dtype=torch.bfloat16, transform=lambda n, t: seen.append(n) or t * 0)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert all(p.abs().sum() == 0 for p in loaded.parameters())
    assert len(seen) == len(loaded.state_dict())


def test_pytorch_bin_is_read_weights_only(tmp_path):
    model = random_model()
    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    loaded = load_checkpoint(ckpt, dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"x": Evil()}, ckpt / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights.only|unsupported global"):
        load_checkpoint(ckpt)


def test_missing_and_wrong_checkpoints_have_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", config=TINY)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no weights"):
        load_checkpoint(tmp_path / "empty", config=TINY)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "empty")
    ckpt = write_hf_dir(tmp_path / "ckpt", random_model())
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(ckpt, config=TINY.replace(n_embd=64))
    sd = load_file(str(ckpt / "model.safetensors"))
    del sd["model.norm.weight"]
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors the model needs: model.norm.weight"):
        load_checkpoint(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_streaming_writer_matches_safetensors_reader(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6, dtype=torch.int64)}
    specs = [TensorSpec(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()]
    write_safetensors(tmp_path / "x.safetensors", specs, metadata={"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert not (tmp_path / "x.safetensors.tmp").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    model = random_model(TINY.replace(tie_embeddings=tied, qkv_bias=True, model_type="qwen2"))
    out = save_hf_checkpoint(tmp_path / "export", model.config, hf_tensor_specs(model, torch.float32), dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    idx = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert (hf(idx).logits - model(idx)).abs().max() <= 1e-4
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == tied
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) == (not tied)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that ops make while the mode is active and that are still alive, and their peak
    (`peak`). Storages of `existing` (the model's own tensors, which views and detach() share) are never counted."""

    def __init__(self, existing):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr not in self.known:
                self.known.add(ptr)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, ptr, nbytes)  # runs when the storage itself is freed
        return out

    def _freed(self, ptr, nbytes):
        self.known.discard(ptr)
        self.live -= nbytes


def inner_tensors(t):
    """`t`, or a tensor subclass's (NF4Tensor's) inner plain tensors."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    return [x for name in t.__tensor_flatten__()[0] for x in inner_tensors(getattr(t, name))]


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_merged_export_holds_one_block_of_rows_at_a_time(tmp_path, monkeypatch, quantize):
    """Issue 16: merging a whole 32000x2048 head in fp32 made ~760 MiB of temporaries and set the run's peak. The
    export streams each weight a block of rows at a time: the bytes that ops allocate and keep alive while the merged
    file is written stay at a few blocks, far below one whole weight in fp32."""
    config = TINY.replace(vocab_size=512, n_embd=64, intermediate_size=96)
    model = random_model(config).to(torch.bfloat16)
    if quantize == "nf4":
        quantize_linears(model)
    apply_lora(model, r=4, alpha=8, targets="all", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    monkeypatch.setattr(lora, "MERGE_CHUNK_ELEMS", 1024)
    largest = max(p.numel() for p in model.parameters()) * 4  # the largest weight, whole, in fp32: 128 KiB
    existing = [x for t in [*model.parameters(), *model.buffers()] for x in inner_tensors(t)]
    with LiveBytes(existing) as live:
        write_safetensors(tmp_path / "merged.safetensors", hf_tensor_specs(model, torch.float32))
    assert 0 < live.peak <= 8 * 1024 * 4 < largest, live.peak  # a few 4 KiB fp32 blocks
    assert live.live == 0  # nothing produced is kept once written
    back = load_file(str(tmp_path / "merged.safetensors"))
    monkeypatch.setattr(lora, "MERGE_CHUNK_ELEMS", 1 << 22)
    assert torch.equal(back["lm_head.weight"], model.lm_head.merged_weight(torch.float32))
    assert torch.equal(back["model.layers.1.mlp.down_proj.weight"],
                       model.model.layers[1].mlp.down_proj.merged_weight(torch.float32))
    assert torch.equal(back["model.embed_tokens.weight"], model.model.embed_tokens.weight.float())


def test_chunked_spec_streams_its_rows_and_checks_them(tmp_path):
    t = torch.randn(10, 3)
    spec = TensorSpec("t", t.shape, t.dtype, chunks=lambda: iter(t.split(4)))
    assert torch.equal(spec.produce(), t)
    write_safetensors(tmp_path / "x.safetensors", [spec])
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["t"], t)
    short = TensorSpec("t", t.shape, t.dtype, chunks=lambda: iter(t[:8].split(4)))
    with pytest.raises(RuntimeError, match="produced 8 rows"):
        write_safetensors(tmp_path / "y.safetensors", [short])
