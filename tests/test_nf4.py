"""lit_qlora.nf4 against torchao's NF4 reference: bit-identical quantization, identical dequantization,
layouts that quantize and shard (FSDP2's dim-0 split), the autograd linear, and storage size."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torchao.quantization import NF4Tensor, to_nf4

import lit_qlora.nf4
from lit_qlora.nf4 import (
    NF4_LEVELS,
    block_aligned_rows,
    clone_nf4,
    dequantize_nf4,
    nf4_backend,
    nf4_layout,
    nf4_linear,
    nf4_nbytes,
    quantize_nf4,
)
from lit_qlora.nf4 import linear as lin
from lit_qlora.nf4.native import use_native
from lit_qlora.nf4.reference import thresholds as nf4_thresholds

INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

NATIVE = [False] + ([True] if nf4_backend() == "native" else [])
native_param = pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "eager")


def skip_unsupported(native: bool, dtype: torch.dtype) -> None:
    if native and not use_native(dtype):
        pytest.skip(f"native kernels built without {dtype} support (gcc without _Float16)")


@pytest.fixture
def backend(monkeypatch, request):
    """Run dequantize_nf4 on the C kernel or the PyTorch path."""
    if not request.param:
        monkeypatch.setenv("LIT_QLORA_NF4_BACKEND", "eager")
    return request.param


backend_param = pytest.mark.parametrize("backend", NATIVE, indirect=True, ids=lambda n: "native" if n else "eager")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bit-exact view (NaN-safe equality)."""
    return torch.empty(t.reshape(-1).shape, dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8)


def assert_same_nf4(ours: NF4Tensor, ref: NF4Tensor) -> None:
    assert isinstance(ours, NF4Tensor)
    for name in INNER:
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(bits(a), bits(b)), f"{name} differs"
    for attr in ("block_size", "scaler_block_size", "n_blocks"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.shape == ref.shape and ours.dtype == ref.dtype and ours.device == ref.device


def weight(shape, dtype, seed=0, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------ layout
def test_levels_match_torchao():
    for dtype in DTYPES:
        assert torch.equal(torch.tensor(NF4_LEVELS, dtype=dtype), to_nf4(torch.zeros(16384, dtype=dtype)).nf4)


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((576, 1536), 256),  # the default where it divides
        ((192, 576), 288),  # SmolLM2 k_proj: 1728 blocks = 6.75 * 256
        ((1031, 64), 1031),  # a prime block count: one scaler block
        ((2, 64 * 3), 6),  # tiny: only divisors below 8 exist
        ((151936, 896), 256),
    ],
)
def test_layout_picks_a_divisor(shape, expected):
    block_size, sbs = nf4_layout(shape)
    assert (block_size, sbs) == (64, expected)
    assert math.prod(shape) % (block_size * sbs) == 0
    if math.prod(shape) < 1 << 20:
        to_nf4(torch.zeros(shape), block_size, sbs)  # torchao accepts it


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("shape", [(192, 576), (576, 1536), (256, 64), (1536, 576), (4100, 64)])
def test_layout_shards_along_dim0(shape, world_size):
    block_size, sbs = nf4_layout(shape, world_size=world_size)
    n_blocks = math.prod(shape) // block_size
    assert n_blocks % sbs == 0 and (n_blocks // sbs) % world_size == 0 and shape[0] % world_size == 0
    t = quantize_nf4(weight(shape, torch.bfloat16), world_size=world_size)
    assert t.scaler_block_size == sbs
    full = t.get_original_weight()
    rows = shape[0] // world_size
    chunks = torch.chunk(t, world_size, dim=0)  # what FSDP2's sharding runs (aten.split on NF4Tensor)
    assert len(chunks) == world_size
    for i, chunk in enumerate(chunks):
        assert isinstance(chunk, NF4Tensor) and chunk.shape == (rows, shape[1])
        assert torch.equal(dequantize_nf4(chunk), full[i * rows : (i + 1) * rows])


def test_default_layout_cannot_shard_but_world_size_layout_can():
    w = weight((256, 64), torch.bfloat16)  # 256 blocks: one scaler block of 256
    with pytest.raises(AssertionError, match="not divisible"):
        torch.chunk(to_nf4(w, 64, 256), 2, dim=0)
    assert nf4_layout(w.shape, world_size=2) == (64, 128)
    torch.chunk(quantize_nf4(w, world_size=2), 2, dim=0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_shard_and_all_gather_roundtrip(world_size):
    """The exact op sequence FSDP2 runs on a parameter (chunk, new_zeros, narrow+copy_, view(-1),
    fsdp_pre_all_gather, all-gather = concatenation, fsdp_post_all_gather) gives back the full tensor."""
    t = quantize_nf4(weight((192, 576), torch.bfloat16), world_size=world_size)
    full = dequantize_nf4(t)
    mesh = types.SimpleNamespace(get_group=lambda: types.SimpleNamespace(size=lambda: world_size))
    shards = []
    for chunk in torch.chunk(t, world_size, dim=0):
        padded = chunk.new_zeros(chunk.size())
        padded.narrow(0, 0, chunk.size(0)).copy_(chunk)
        assert padded.view(-1).shape == (chunk.numel(),)
        shards.append(padded)
    pre = [s.fsdp_pre_all_gather(mesh) for s in shards]
    gathered = tuple(torch.cat([inputs[i] for inputs, _ in pre]) for i in range(3))
    unsharded, _ = shards[0].fsdp_post_all_gather(gathered, pre[0][1], torch.bfloat16)
    assert unsharded.shape == t.shape
    assert torch.equal(dequantize_nf4(unsharded), full)


def test_layout_errors():
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        nf4_layout((100, 10))
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        quantize_nf4(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="not divisible by the world size"):
        nf4_layout((6, 64), world_size=4)
    with pytest.raises(ValueError, match="fraction of a 64-element block"):
        nf4_layout((4, 32), world_size=4)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_nf4(torch.zeros(192, 576), scaler_block_size=256)
    with pytest.raises(ValueError, match="split evenly"):
        quantize_nf4(torch.zeros(256, 64), scaler_block_size=256, world_size=2)
    with pytest.raises(TypeError):
        quantize_nf4(torch.zeros(64, 64, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ exactness
CASES = [
    ((192, 576), torch.bfloat16),  # non-default scaler block size (288)
    ((192, 576), torch.float16),
    ((192, 576), torch.float32),
    ((576, 1536), torch.bfloat16),
    ((1536, 576), torch.float32),
    ((8192, 576), torch.bfloat16),  # a slice of SmolLM2's 49152x576 embedding/head
    ((1031, 64), torch.bfloat16),  # prime block count
    ((4, 64 * 31), torch.float16),  # prime block count, few rows
    ((300, 96), torch.bfloat16),  # rows do not hold whole blocks: chunks of an even number of rows
    ((64 * 40,), torch.float32),  # 1-D
]


@native_param
@pytest.mark.parametrize("shape, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_quantize_matches_torchao(shape, dtype, native):
    skip_unsupported(native, dtype)
    w = weight(shape, dtype, seed=len(shape) + shape[0])
    layout = nf4_layout(shape)
    ref = to_nf4(w, *layout)
    ours = quantize_nf4(w, chunk_rows=14, native=native)  # many chunks
    assert_same_nf4(ours, ref)
    assert ours.stride() == ref.stride()
    assert_same_nf4(quantize_nf4(w, native=native), ref)


@backend_param
@pytest.mark.parametrize("shape, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_dequantize_matches_torchao(shape, dtype, backend):
    ref = to_nf4(weight(shape, dtype, seed=3), *nf4_layout(shape))
    expected = ref.get_original_weight()
    got = dequantize_nf4(ref)  # reads torchao's own NF4Tensor
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    for out_dtype in DTYPES:
        assert torch.equal(dequantize_nf4(ref, out_dtype), expected.to(out_dtype))
    out = torch.empty(shape, dtype=torch.float32)
    assert dequantize_nf4(ref, torch.float32, out=out) is out
    assert torch.equal(out, expected.float())


@native_param
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_value_gets_torchaos_code(dtype, native):
    """Blocks with absmax 1 hold every finite value in [-1, 1], so w / absmax runs through all of them:
    the nearest-level search, its rounding and tie-breaking match torchao exactly."""
    skip_unsupported(native, dtype)
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[values.float().abs() <= 1]
    per_block = 63
    n_blocks = -(-values.numel() // per_block)
    n_blocks += -n_blocks % 64
    body = torch.zeros(n_blocks * per_block, dtype=dtype)
    body[: values.numel()] = values
    w = torch.cat([torch.ones(n_blocks, 1, dtype=dtype), body.view(n_blocks, per_block)], dim=1)
    ref = to_nf4(w, *nf4_layout(w.shape))
    ours = quantize_nf4(w, native=native)
    assert_same_nf4(ours, ref)
    assert torch.equal(dequantize_nf4(ours), ref.get_original_weight())


@native_param
def test_float32_values_next_to_every_threshold(native):
    thresholds = torch.tensor(nf4_thresholds(torch.float32))
    near = torch.cat([(thresholds.view(torch.int32) + k).view(torch.float32) for k in range(-150, 150)])
    near = torch.cat([near, -near, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    g = torch.Generator().manual_seed(0)
    near = torch.cat([near, torch.rand(63 * 4096 - near.numel() % 63, generator=g) * 2 - 1])
    n_blocks = near.numel() // 63
    w = torch.cat([torch.ones(n_blocks, 1), near[: n_blocks * 63].view(n_blocks, 63)], dim=1)
    w = w[: n_blocks - n_blocks % 64]
    assert_same_nf4(quantize_nf4(w, native=native), to_nf4(w, *nf4_layout(w.shape)))


@native_param
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_outlier_blocks(dtype, native):
    skip_unsupported(native, dtype)
    w = weight((128, 256), dtype)
    w[3] = 0  # all-zero blocks (0 / 0 -> code 0, as in torchao)
    w[7, 5] = 60000.0 if dtype == torch.float16 else 1e6  # one block dominated by an outlier
    w[9, 64:128] = -0.5  # a constant block
    ref = to_nf4(w, *nf4_layout(w.shape))
    ours = quantize_nf4(w, native=native)
    assert_same_nf4(ours, ref)
    # with float16 this outlier overflows torchao's scaler math into NaN rows: same NaNs, same numbers elsewhere
    torch.testing.assert_close(dequantize_nf4(ours), ref.get_original_weight(), rtol=0, atol=0, equal_nan=True)


def test_non_contiguous_and_requires_grad_input():
    base = weight((576, 192), torch.bfloat16)
    w = base.t()  # non-contiguous view: quantized chunk by chunk
    ours = quantize_nf4(w, chunk_rows=16)
    assert_same_nf4(ours, to_nf4(w.contiguous(), *nf4_layout(w.shape)))
    assert ours.stride() == (576, 1)  # the data is row-major
    p = torch.nn.Parameter(weight((128, 64), torch.float32))
    assert quantize_nf4(p).requires_grad == to_nf4(p, 64, 128).requires_grad


@pytest.mark.parametrize(
    "shape",
    [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096), (1024, 4096), (896, 4864)],
)
def test_resident_bytes_per_parameter(shape):
    t = quantize_nf4(torch.empty(shape, dtype=torch.bfloat16).normal_(std=0.02))
    assert nf4_nbytes(t) / t.numel() <= 0.52


# ------------------------------------------------------------------------------------------------ linear
@backend_param
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_linear_matches_autograd_through_dequantized_weight(dtype, backend):
    t = quantize_nf4(weight((192, 576), dtype))
    param = torch.nn.Parameter(t, requires_grad=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 576, generator=g).to(dtype).requires_grad_()
    b = torch.randn(192, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 192, generator=g).to(dtype)

    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        y = nf4_linear(x, param, b)
    # only the NF4 weight is kept for backward, never a dequantized copy
    assert not any(s.shape == t.shape and not isinstance(s, NF4Tensor) for s in saved)
    y.backward(grad)

    x2 = x.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_()
    y2 = F.linear(x2, t.get_original_weight().to(dtype), b2)
    y2.backward(grad)
    assert torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_nf4_linear_without_bias_and_frozen_input():
    t = quantize_nf4(weight((64, 128), torch.bfloat16))
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert torch.equal(nf4_linear(x, t), F.linear(x, t.get_original_weight()))
    b = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    nf4_linear(x, t, b).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((64,), 4.0, dtype=torch.bfloat16))


def test_nf4_linear_under_autocast():
    t = quantize_nf4(weight((64, 128), torch.bfloat16))
    x = torch.randn(4, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = nf4_linear(x, t)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.detach().bfloat16(), t.get_original_weight()))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32


def test_nf4_linear_chain_reuses_scratch_correctly():
    """Two NF4 linears of different sizes in a row (the CPU scratch buffer is shared), forward and backward."""
    t1 = quantize_nf4(weight((256, 128), torch.bfloat16, seed=1))
    t2 = quantize_nf4(weight((64, 256), torch.bfloat16, seed=2))
    x = torch.randn(2, 7, 128, dtype=torch.bfloat16, requires_grad=True)
    y = nf4_linear(torch.relu(nf4_linear(x, t1)), t2)
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = F.linear(torch.relu(F.linear(x2, t1.get_original_weight())), t2.get_original_weight())
    y2.square().sum().backward()
    assert torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad)


def test_validation_and_training_share_one_scratch_buffer(monkeypatch):
    """Inference mode (validation, generation) dequantizes into the same CPU scratch buffer training then writes:
    one buffer, not one per mode held through training, and training after validation still computes right."""
    monkeypatch.setattr(lin, "_scratch", __import__("threading").local())
    t = quantize_nf4(weight((256, 128), torch.bfloat16, seed=4))
    x = torch.randn(3, 128, dtype=torch.bfloat16, requires_grad=True)
    dense = t.get_original_weight()
    with torch.inference_mode():
        assert torch.equal(nf4_linear(x.detach(), t), F.linear(x.detach(), dense))
    y = nf4_linear(x, t)
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2, dense).square().sum().backward()
    assert torch.equal(y, F.linear(x2.detach(), dense)) and torch.equal(x.grad, x2.grad)
    key = (torch.device("cpu"), torch.bfloat16)
    assert list(lin._scratch.buffers) == [key]
    assert not lin._scratch.buffers[key].is_inference()


class _ToyQLoRA(torch.nn.Module):
    def __init__(self, base: NF4Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(base, requires_grad=False)
        self.lora = torch.nn.Linear(base.shape[1], base.shape[0], bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight) + self.lora(x)


def _fsdp2_worker(rank: int, world_size: int, init_file: str, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    try:
        for layout_world_size in (1, world_size):
            torch.manual_seed(0)  # the same LoRA init on every rank
            t = quantize_nf4(weight((256, 64), torch.bfloat16), world_size=layout_world_size)  # 256 blocks
            model = _ToyQLoRA(t)
            lora = model.lora.weight.detach().clone()
            try:
                fully_shard(model, mesh=mesh)
            except AssertionError as e:  # torchao's split of the inner tensors
                results[layout_world_size] = ("rejected", str(e))
                continue
            local = model.weight.to_local()
            x = torch.randn(3, 64, dtype=torch.bfloat16)
            y = model(x)  # FSDP2 all-gathers the NF4 shards (fsdp_pre/post_all_gather) before forward
            y.sum().backward()
            expected = F.linear(x, t.get_original_weight()) + F.linear(x, lora)
            same = torch.equal(y.detach(), expected) and model.lora.weight.grad is not None
            results[layout_world_size] = (type(local).__name__, tuple(local.shape), same)
    except Exception as e:  # report, do not hang the parent
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        queue.put((rank, results))
        dist.destroy_process_group()


@pytest.mark.slow
def test_real_fsdp2_shards_nf4_on_cpu(tmp_path):
    """fully_shard over 2 gloo ranks (spawned processes, ~10 s): the world_size=2 layout shards, all-gathers
    and runs forward/backward; the default layout (one scaler block for 256 blocks) is rejected."""
    import torch.distributed as dist
    from helpers import spawn_ranks

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo unavailable")
    results = spawn_ranks(_fsdp2_worker, 2, 2, str(tmp_path / "store"), timeout=180)
    for rank in range(2):
        res = results[rank]
        assert "error" not in res, res
        assert res[1][0] == "rejected" and "not divisible" in res[1][1], res
        assert res[2] == ("NF4Tensor", (128, 64), True), res


def test_torch_compile_runs_the_kernels_eagerly():
    """dynamo must not trace the raw-pointer kernels (it silently loses their writes): they are
    compiler-disabled, so a compiled model gives the eager results (backend="eager" shows the bug cheaply)."""
    t = quantize_nf4(weight((256, 512), torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(256, dtype=torch.bfloat16))

    def f(x):
        return torch.relu(nf4_linear(x, t, b)) * 2

    x = torch.randn(4, 512, dtype=torch.bfloat16, requires_grad=True)
    expected = f(x)
    expected.sum().backward()
    grad = x.grad
    x.grad = None
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager")(x)
    got.sum().backward()
    assert torch.equal(got, expected) and torch.equal(x.grad, grad)
    roundtrip = torch.compile(lambda w: dequantize_nf4(quantize_nf4(w)), backend="eager")
    w = weight((128, 256), torch.bfloat16)
    assert torch.equal(roundtrip(w), dequantize_nf4(quantize_nf4(w)))


def test_clone_nf4_is_exact_where_torchaos_clone_fails():
    t = quantize_nf4(weight((192, 576), torch.bfloat16))  # scaler_block_size 288
    with pytest.raises(AssertionError):
        t.clone()  # torchao re-quantizes with the default (64, 256) layout
    c = clone_nf4(t)
    assert_same_nf4(c, t)
    assert c.quantized_data.data_ptr() != t.quantized_data.data_ptr()


def test_nf4_linear_after_inference_mode_still_trains():
    # Regression: the per-thread dequantize buffer, first made under inference_mode (generate/evaluate),
    # must not break a later autograd forward in the same process.
    w = quantize_nf4(torch.randn(128, 256, dtype=torch.bfloat16))
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    with torch.inference_mode():
        nf4_linear(x.detach(), w)
    nf4_linear(x, w).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


# ------------------------------------------------------------------------------------ row slices (lm_head)
@backend_param
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_rows_equals_the_slice_of_the_whole(dtype, backend):
    t = quantize_nf4(weight((200, 72), torch.bfloat16))  # 72 columns: a block spans rows, rows step 8
    whole = dequantize_nf4(t, dtype)
    step = block_aligned_rows(t, 8 * 72 * 3)
    assert step == 24 and (step * 72) % t.block_size == 0
    assert block_aligned_rows(t, 1) == 8  # never less than one whole number of blocks
    for start in range(0, 200, step):
        stop = min(200, start + step)
        assert torch.equal(dequantize_nf4(t, dtype, rows=(start, stop)), whole[start:stop])
    with pytest.raises(ValueError, match="quantization blocks"):
        dequantize_nf4(t, dtype, rows=(3, 24))
    with pytest.raises(ValueError, match="row range"):
        dequantize_nf4(t, dtype, rows=(0, 201))


@backend_param
def test_large_weight_runs_in_row_slices_with_a_small_dense_copy(monkeypatch, backend):
    """A weight over DENSE_CHUNK_ELEMS is multiplied a block-aligned slice of rows at a time (ragged last slice):
    same outputs and gradients as one dense matmul, and the CPU scratch never holds more than one slice."""
    monkeypatch.setattr(lin, "DENSE_CHUNK_ELEMS", 64 * 576)
    monkeypatch.setattr(lin, "_scratch", __import__("threading").local())
    t = quantize_nf4(weight((200, 576), torch.bfloat16))
    assert lin._row_slices(t) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 576, generator=g).bfloat16().requires_grad_()
    b = torch.randn(200, generator=g).bfloat16().requires_grad_()
    y = lin.nf4_linear(x, t, b)
    grad = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(grad)
    assert max(buf.numel() for buf in lin._scratch.buffers.values()) == 64 * 576

    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y2 = F.linear(x2, t.get_original_weight(), b2)
    y2.backward(grad)
    # Against fp32 math: forward is one bf16 rounding as in the dense matmul; in backward each slice's bf16
    # partial product is rounded once more before the fp32 sum (CPU has no bf16 x bf16 -> fp32 matmul), so the
    # error may be up to ~2x the dense one; a wrong slice or offset would be off by the values themselves.
    w32 = t.get_original_weight().float()
    for got, dense, exact in ((y, y2, F.linear(x2.detach().float(), w32, b2.detach().float())),
                              (x.grad, x2.grad, grad.float() @ w32)):
        err, dense_err = (got.float() - exact).abs(), (dense.float() - exact).abs()
        assert err.max() <= 2 * dense_err.max() and err.mean() <= 2 * dense_err.mean()
    assert torch.equal(b.grad, b2.grad)


def test_backward_dequantizes_whole_when_the_sliced_sum_would_be_larger(monkeypatch):
    """With many tokens through a wide weight, the fp32 sum of sliced partial products (tokens x in x 4 bytes)
    would outgrow the whole dense weight (out x in x 2): backward then dequantizes whole, and its input gradient is
    the dense matmul's exactly (no extra rounding of partial products)."""
    monkeypatch.setattr(lin, "DENSE_CHUNK_ELEMS", 64 * 576)
    monkeypatch.setattr(lin, "_scratch", __import__("threading").local())
    t = quantize_nf4(weight((200, 576), torch.bfloat16))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 50, 576, generator=g).bfloat16().requires_grad_()  # 100 tokens x 4 B >= 200 rows x 2 B
    y = lin.nf4_linear(x, t)
    assert max(buf.numel() for buf in lin._scratch.buffers.values()) == 64 * 576  # forward: still sliced
    grad = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(grad)
    assert max(buf.numel() for buf in lin._scratch.buffers.values()) == 200 * 576  # backward: whole
    assert torch.equal(x.grad, grad @ t.get_original_weight())


def test_star_import_gives_every_public_name():
    namespace: dict = {}
    exec("from lit_qlora.nf4 import *", namespace)
    assert set(lit_qlora.nf4.__all__) <= set(namespace)
    for name in lit_qlora.nf4.__all__:
        assert namespace[name] is getattr(lit_qlora.nf4, name)
    assert {"quantize_nf4", "dequantize_nf4", "is_nf4", "nf4_layout", "nf4_linear", "FrozenNF4Linear",
            "quantize_linears", "count_linears"} <= set(lit_qlora.nf4.__all__)


def test_storage_layer_never_imports_the_adapter_layer():
    """lit_qlora.nf4 is below LoRA: importing it (in a fresh interpreter) loads no lit_qlora module outside it but
    the base layer's (lit_qlora.base: the errors its layout checks raise, the ISA its C kernels are built for,
    torchao's import warnings silenced, the switches it reads, the OpenMP spin the package root sets, the stash a
    checkpointed block's recompute reads its experts' products from)."""
    import subprocess
    import sys

    code = ("import sys, lit_qlora.nf4; print(sorted(m for m in sys.modules if m.startswith('lit_qlora.') "
            "and not m.startswith('lit_qlora.nf4')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([f"lit_qlora.base{m}" for m in ("", ".errors", ".hardware", ".quiet", ".recompute",
                                                               ".switches", ".threads")])


def test_kernel_source_is_package_data_and_keys_the_build_cache(tmp_path, monkeypatch):
    """kernels.c ships beside native.py; the cached library's name changes with the source text."""
    from lit_qlora.nf4 import native

    source = native.kernel_source()
    assert "void nf4_quantize(" in source and "void nf4_dequant16(" in source
    if native.native_lib() is None:
        pytest.skip(f"no native kernels here: {native.native_error()}")
    monkeypatch.setenv("LIT_QLORA_KERNEL_CACHE", str(tmp_path))
    native._compile_native()
    monkeypatch.setattr(native, "kernel_source", lambda: source + "\n/* edited */\n")
    native._compile_native()
    assert len(list(tmp_path.glob("nf4_*.so"))) == 2
