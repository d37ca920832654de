"""torch tensors as logprobs() inputs: hidden bf16 / fp16 / fp32 (CPU or CUDA)
and integer targets give the request, and so the answer's bits, of the same
values passed as numpy; bf16 is sent as its bits (DTYPE_BFLOAT16), with no
float32 detour, and a CUDA tensor is copied to the host once.

The first tests use a stand-in `torch` module (CI has no torch); the tests
marked by `pytest.importorskip("torch")` use the real one, on the GPU too
when there is one, and against the server."""

import asyncio
import subprocess
import sys
import types

import numpy as np
import pytest
from detlogp import requests, tensors
from detlogp.aio import AsyncClient
from detlogp.v1 import detlogp_pb2 as pb


# ------------------------------------------------------------ a stand-in torch
class _Dtype:
    def __init__(self, name, np_dtype, floating=False, complex_=False):
        self.name, self.np_dtype = name, np.dtype(np_dtype)
        self.is_floating_point, self.is_complex = floating, complex_

    def __repr__(self):
        return f"torch.{self.name}"


class FakeTensor:
    """What the client uses of torch.Tensor, over a numpy array (bf16 held
    as its uint16 bits); every call that moves data is logged."""

    def __init__(self, array, dtype, device="cpu", log=None):
        self._array, self.dtype = array, dtype
        self.device = types.SimpleNamespace(type=device)
        self.log = [] if log is None else log

    def _like(self, array, dtype=None, device=None):
        return FakeTensor(array, dtype or self.dtype, device or self.device.type, self.log)

    @property
    def shape(self):
        return self._array.shape

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    def detach(self):
        return self

    def contiguous(self):
        return self._like(np.ascontiguousarray(self._array))

    def view(self, dtype):
        assert dtype.np_dtype.itemsize == self.dtype.np_dtype.itemsize
        return self._like(self._array.view(dtype.np_dtype), dtype)

    def to(self, dtype):
        self.log.append(("to", dtype.name))
        raise AssertionError("no dtype conversion expected")

    def cpu(self):
        self.log.append(("cpu", self.device.type))
        return self._like(self._array.copy(), device="cpu")

    def copy_(self, source):
        self.log.append(("copy_", source.device.type, self.device.type))
        np.copyto(self._array, source._array)
        return self

    def numpy(self):
        if self.device.type != "cpu":
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        return self._array


FakeTensor.__module__ = "torch"  # what is_torch_tensor looks at


def _fake_torch(log):
    torch = types.ModuleType("torch")
    torch.bfloat16 = _Dtype("bfloat16", np.uint16, floating=True)
    torch.float16 = _Dtype("float16", np.float16, floating=True)
    torch.float32 = _Dtype("float32", np.float32, floating=True)
    torch.float64 = _Dtype("float64", np.float64, floating=True)
    torch.bool = _Dtype("bool", np.bool_)
    for name in ("uint8", "int8", "int16", "int32", "int64"):
        setattr(torch, name, _Dtype(name, name))

    def empty(shape, dtype, pin_memory=False):
        log.append(("empty", pin_memory))
        return FakeTensor(np.empty(shape, dtype.np_dtype), dtype, "cpu", log)

    torch.empty = empty
    return torch


@pytest.fixture
def fake_torch(monkeypatch):
    log = []
    torch = _fake_torch(log)
    monkeypatch.setitem(sys.modules, "torch", torch)
    torch.log = log
    return torch


def _rows(n=5, h=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, h)).astype(np.float32), rng.integers(0, 1000, size=n))


def _same_request(a, b):
    assert a.hidden.dtype == b.hidden.dtype
    assert list(a.hidden.shape) == list(b.hidden.shape)
    assert a.hidden.data == b.hidden.data
    assert list(a.target_ids) == list(b.target_ids)
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "dtype,wire",
    [("bfloat16", pb.DTYPE_BFLOAT16), ("float16", pb.DTYPE_FLOAT16), ("float32", pb.DTYPE_FLOAT32)],
)
def test_fake_torch_hidden_is_sent_as_its_own_dtype(fake_torch, device, dtype, wire):
    hidden, targets = _rows()
    if dtype == "bfloat16":
        values = tensors.float32_to_bf16_bits(hidden)  # the numpy way: bf16 bits
    else:
        values = hidden.astype(dtype)
    tensor = FakeTensor(values.copy(), getattr(fake_torch, dtype), device, fake_torch.log)
    ids = FakeTensor(targets.astype(np.int32), fake_torch.int32, device, fake_torch.log)
    got = requests.logprob_request(tensor, ids, return_lse=True, model="policy", version=3)
    want = requests.logprob_request(values, targets, return_lse=True, model="policy", version=3)
    assert got.hidden.dtype == wire
    _same_request(got, want)
    moves = [entry for entry in fake_torch.log if entry[0] in ("to", "cpu", "copy_")]
    if device == "cuda":
        # hidden and targets: each copied to the host once, into pinned memory.
        assert moves == [("copy_", "cuda", "cpu")] * 2
        assert [e for e in fake_torch.log if e[0] == "empty"] == [("empty", True)] * 2
    else:
        assert moves == []


def test_fake_torch_non_contiguous_rows(fake_torch):
    hidden, targets = _rows(n=10)
    bits = tensors.float32_to_bf16_bits(hidden)
    view = FakeTensor(bits[::2], fake_torch.bfloat16, "cuda", fake_torch.log)
    assert not view._array.flags.c_contiguous
    _same_request(
        requests.logprob_request(view, targets[::2]),
        requests.logprob_request(bits[::2], targets[::2]),
    )


def test_fake_torch_targets_of_any_integer_dtype(fake_torch):
    hidden, targets = _rows()
    targets = targets % 200  # uint8 holds them
    want = requests.logprob_request(hidden, targets)
    for name in ("uint8", "int16", "int32", "int64"):
        ids = FakeTensor(targets.astype(name), getattr(fake_torch, name), "cuda", fake_torch.log)
        got = requests.logprob_request(hidden, ids)
        assert list(got.target_ids) == list(want.target_ids)
        assert all(type(t) is int for t in tensors.target_ids(ids))


def test_fake_torch_wrong_dtypes_are_refused(fake_torch):
    hidden, targets = _rows()
    floats = FakeTensor(targets.astype(np.float32), fake_torch.float32)
    with pytest.raises(TypeError, match="targets torch dtype torch.float32"):
        requests.logprob_request(hidden, floats)
    flags = FakeTensor(targets > 3, fake_torch.bool)
    with pytest.raises(TypeError, match="not an integer type"):
        requests.logprob_request(hidden, flags)
    ints = FakeTensor(hidden.astype(np.int32), fake_torch.int32)
    with pytest.raises(TypeError, match="hidden torch dtype torch.int32"):
        requests.logprob_request(ints, targets)


def test_stream_items_take_torch_tensors(fake_torch):
    from detlogp import _common

    hidden, targets = _rows()
    tensor = FakeTensor(hidden.copy(), fake_torch.float32, "cuda", fake_torch.log)
    ids = FakeTensor(targets.copy(), fake_torch.int64, "cuda", fake_torch.log)
    for item in [(tensor, ids), dict(hidden=tensor, targets=ids)]:
        got = _common.stream_item_to_request(item, 0, None, None)
        want = _common.stream_item_to_request((hidden, targets), 0, None, None)
        assert got.hidden == want.hidden and list(got.target_ids) == list(want.target_ids)


def test_numpy_requests_do_not_import_torch():
    code = (
        "import sys, numpy, detlogp;"
        "from detlogp import requests;"
        "requests.logprob_request(numpy.zeros((2, 8), numpy.float32), [1, 2]);"
        "requests.logprob_request(numpy.zeros((2, 8), numpy.uint16), numpy.arange(2));"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------ the real torch
def _real_torch_devices(torch):
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _torch_and_numpy(torch, hidden, dtype, device):
    """The same values as a torch tensor of `dtype` on `device` and as the
    numpy array one would pass instead."""
    if dtype == "bfloat16":
        values = tensors.float32_to_bf16_bits(hidden)
        tensor = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    else:
        values = hidden.astype(dtype)
        tensor = torch.from_numpy(values)
    return tensor.to(device), values


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_real_torch_requests_equal_numpy_requests(dtype):
    torch = pytest.importorskip("torch")
    hidden, targets = _rows(n=12, h=16, seed=3)
    for device in _real_torch_devices(torch):
        tensor, values = _torch_and_numpy(torch, hidden, dtype, device)
        for ids in (
            torch.from_numpy(targets).to(device),
            torch.from_numpy(targets.astype(np.int32)).to(device),
        ):
            _same_request(
                requests.logprob_request(tensor, ids), requests.logprob_request(values, targets)
            )
        # A strided view and a tensor that requires grad.
        _same_request(
            requests.logprob_request(tensor[::3], targets[::3]),
            requests.logprob_request(values[::3], targets[::3]),
        )
        graded = tensor.clone().requires_grad_(True)
        _same_request(
            requests.logprob_request(graded, targets), requests.logprob_request(values, targets)
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_real_torch_answers_have_the_bits_of_numpy(client, model, dtype):
    torch = pytest.importorskip("torch")
    hidden, targets = model.random_rows(16, seed=71)
    for device in _real_torch_devices(torch):
        tensor, values = _torch_and_numpy(torch, hidden, dtype, device)
        want = client.logprobs(values, targets, return_lse=True)
        got = client.logprobs(tensor, torch.from_numpy(targets).to(device), return_lse=True)
        assert got.logprobs.tobytes() == want.logprobs.tobytes()
        assert got.lse.tobytes() == want.lse.tobytes()
        assert got.determinism_key == want.determinism_key
        streamed = list(client.stream([(tensor, torch.from_numpy(targets).to(device))]))
        assert streamed[0].logprobs.tobytes() == want.logprobs.tobytes()


def test_real_torch_async_client_has_the_bits_of_numpy(server, client, model):
    torch = pytest.importorskip("torch")
    hidden, targets = model.random_rows(8, seed=72)
    bits = tensors.float32_to_bf16_bits(hidden)
    want = client.logprobs(bits, targets, return_lse=True)

    async def main(device):
        tensor = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(device)
        async with AsyncClient(server.target, timeout=20.0) as aclient:
            return await aclient.logprobs(
                tensor, torch.from_numpy(targets).to(device), return_lse=True
            )

    for device in _real_torch_devices(torch):
        got = asyncio.run(main(device))
        assert got.logprobs.tobytes() == want.logprobs.tobytes()
        assert got.lse.tobytes() == want.lse.tobytes()
