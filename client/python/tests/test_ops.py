"""detlogp.ops on the CPU: the trainer-side ops give exactly
the CPU server's bits for the same weights and rows, and its determinism key.

Nothing is built here: bazel-bin/kernels/capi/libdetlogp_ops.so (or
$DETLOGP_OPS_LIBRARY), the server binary and the installed package's own
library (compiled by `pip install ./client/python`) must exist;
tools/test_python.sh builds all three.
"""

import os
import subprocess
import sys

import detlogp
import numpy as np
import pytest
from detlogp import libraries, ops, safetensors_io, tensors
from detlogp.testing import LocalServer, TestModel

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    ml_dtypes = None


@pytest.fixture(scope="module", autouse=True)
def ops_library(repo_root):
    path = ops.find_library(repo_root)
    if path is None or not path.exists():
        pytest.fail(
            "no ops library: run `bazel build //kernels/capi:libdetlogp_ops.so` "
            f"in {repo_root} (or set {ops.LIBRARY_ENV})",
            pytrace=False,
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ops.LIBRARY_ENV, str(path))
        yield path


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def projection(tmp_path_factory):
    """H3 projection weights written to a safetensors file."""
    rng = np.random.default_rng(23)
    weight = (rng.standard_normal((ops.H3_OUT_DIM, ops.H3_IN_DIM)) * 0.1).astype(np.float32)
    bias = (rng.standard_normal(ops.H3_OUT_DIM) * 0.1).astype(np.float32)
    path = tmp_path_factory.mktemp("proj") / "proj.safetensors"
    safetensors_io.write(path, {"proj.weight": weight, "proj.bias": bias})
    return path, weight, bias


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """No bias, no padding, several vocabulary splits."""
    return TestModel(
        tmp_path_factory.mktemp("plain"),
        hidden=96,
        vocab=3000,
        padded_vocab=3000,
        seed=11,
        scale=0.3,
        with_bias=False,
    )


@pytest.fixture(scope="module")
def plain_server(server_binary, plain_model, projection):
    with LocalServer(
        server_binary,
        plain_model.flags + [f"--projection_weights={projection[0]}", "--cpu_threads=2"],
    ) as srv:
        yield srv


@pytest.fixture
def plain_client(plain_server):
    with detlogp.Client(plain_server.target, timeout=30.0) as c:
        yield c


def served(client, hidden, targets, temperature):
    result = client.logprobs(hidden, targets, temperature=temperature, return_lse=True)
    return result.logprobs, result.lse


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_linear_logp_bits_equal_the_cpu_server_bias_and_padding(client, model, temperature):
    # model: 1000 real tokens in 1024 rows, with a bias.
    hidden, targets = model.random_rows(48, seed=101)
    want_logp, want_lse = served(client, hidden, targets, temperature)
    logp, lse = ops.linear_logp(
        hidden,
        model.weight_bits,
        targets,
        bias=model.bias,
        temperature=temperature,
        vocab_size=model.vocab,
        return_lse=True,
    )
    assert logp.dtype == np.float32 and lse.dtype == np.float32
    assert same_bits(logp, want_logp)
    assert same_bits(lse, want_lse)
    # The thread count never changes bits; lse is optional.
    alone = ops.linear_logp(
        hidden,
        model.weight_bits,
        targets,
        bias=model.bias,
        temperature=temperature,
        vocab_size=model.vocab,
        num_threads=1,
    )
    assert same_bits(alone, want_logp)


def test_linear_logp_bits_equal_the_cpu_server_no_bias(plain_client, plain_model):
    hidden, targets = plain_model.random_rows(40, seed=202)
    want_logp, want_lse = served(plain_client, hidden, targets, 1.0)
    logp, lse = ops.linear_logp(hidden, plain_model.weight_bits, targets, return_lse=True)
    assert same_bits(logp, want_logp) and same_bits(lse, want_lse)
    # The weight as float32 (exactly the bf16 values) rounds to the same bits.
    weight32 = tensors.bf16_bits_to_float32(plain_model.weight_bits)
    assert same_bits(ops.linear_logp(hidden, weight32, targets), want_logp)


def test_linear_logp_takes_bf16_hidden_and_per_row_temperatures(client, model):
    hidden, targets = model.random_rows(8, seed=303)
    bits = tensors.float32_to_bf16_bits(hidden)
    want = client.logprobs(bits, targets, temperature=1.3).logprobs
    got = ops.linear_logp(
        bits, model.weight_bits, targets, bias=model.bias, temperature=1.3, vocab_size=model.vocab
    )
    assert same_bits(got, want)
    if ml_dtypes is not None:
        got_bf16 = ops.linear_logp(
            bits.view(ml_dtypes.bfloat16),
            model.weight_bits.view(ml_dtypes.bfloat16),
            targets,
            bias=model.bias,
            temperature=1.3,
            vocab_size=model.vocab,
        )
        assert same_bits(got_bf16, want)
    # A temperature per row: each row's bits are its own request's bits.
    temps = np.array([0.5, 1.0, 1.5, 2.0, 0.5, 1.0, 1.5, 2.0], np.float32)
    per_row = ops.linear_logp(
        hidden,
        model.weight_bits,
        targets,
        bias=model.bias,
        temperature=temps,
        vocab_size=model.vocab,
    )
    for r in range(len(temps)):
        one = client.logprobs(
            hidden[r : r + 1], targets[r : r + 1], temperature=float(temps[r])
        ).logprobs
        assert same_bits(per_row[r : r + 1], one), r


def test_determinism_key_is_the_cpu_servers(client, model, plain_client, plain_model):
    assert (
        ops.determinism_key(model.weight_bits, model.bias, model.vocab)
        == client.info().determinism_key
    )
    assert ops.determinism_key(plain_model.weight_bits) == plain_client.info().determinism_key
    # Every input counts: the bias, the vocabulary.
    keys = {
        ops.determinism_key(model.weight_bits, model.bias, model.vocab),
        ops.determinism_key(model.weight_bits, None, model.vocab),
        ops.determinism_key(model.weight_bits, model.bias, model.vocab - 1),
    }
    assert len(keys) == 3


def test_h3_projection_bits_equal_the_servers_project(plain_client, projection):
    _, weight, bias = projection
    x = np.random.default_rng(404).standard_normal((7, ops.H3_IN_DIM)).astype(np.float32)
    want = plain_client.project(x, timeout=60).y
    got = ops.h3_projection(x, weight, bias)
    assert got.shape == (7, ops.H3_OUT_DIM) and got.dtype == np.float32
    assert same_bits(got, want)
    assert same_bits(ops.h3_projection(x[2:3], weight, bias, num_threads=1), want[2:3])


def test_invalid_targets_are_rejected_naming_targets(model):
    hidden, targets = model.random_rows(4, seed=505)
    for bad in (model.vocab, -1, model.padded_vocab):
        t = targets.copy()
        t[2] = bad
        with pytest.raises(ValueError, match=r"targets\[2\]"):
            ops.linear_logp(hidden, model.weight_bits, t, bias=model.bias, vocab_size=model.vocab)
    with pytest.raises(ValueError, match="targets"):
        ops.linear_logp(
            hidden, model.weight_bits, targets[:3], bias=model.bias, vocab_size=model.vocab
        )
    with pytest.raises(ValueError, match="hidden"):
        ops.linear_logp(hidden[:, :10], model.weight_bits, targets, vocab_size=model.vocab)
    with pytest.raises(ValueError, match="vocab_size"):
        ops.linear_logp(hidden, model.weight_bits, targets, vocab_size=model.padded_vocab + 1)
    with pytest.raises(ValueError, match="temperatures"):  # from the C ABI
        ops.linear_logp(hidden, model.weight_bits, targets, temperature=0.0, vocab_size=model.vocab)


def test_cuda_asked_for_where_missing_is_a_clear_error(model, monkeypatch):
    """Without the CUDA library (or PyTorch, or an sm_90 GPU) a CUDA call
    names what is missing; mixing host and CUDA arrays is refused."""
    hidden, targets = model.random_rows(2, seed=606)
    with pytest.raises(ValueError, match="hidden, weight, targets not on the CUDA"):
        ops.linear_logp(hidden, model.weight_bits, targets, device="cuda")

    class FakeCudaArray:
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    with pytest.raises(ValueError, match="x not on the CPU"):
        ops.h3_projection(FakeCudaArray(), np.zeros((5376, 96), np.float32), device="cpu")
    monkeypatch.setattr(libraries, "_cuda_lib", None)
    monkeypatch.setenv(ops.CUDA_LIBRARY_ENV, "/nonexistent/libdetlogp_ops_cuda.so")
    ok, why = ops.cuda_available()
    assert not ok and "libdetlogp_ops_cuda.so" in why
    with pytest.raises(RuntimeError, match="libdetlogp_ops_cuda.so"):
        ops.determinism_key(model.weight_bits, device="cuda:0")


def test_cuda_key_is_the_cuda_servers_and_not_the_cpus(repo_root, model):
    """The CUDA key needs the CUDA library but no GPU; it differs from the
    CPU key (another backend) and, like it, depends on the weights."""
    path = ops.find_cuda_library(repo_root)
    if path is None:
        pytest.skip(
            "no libdetlogp_ops_cuda.so built (bazel build "
            "//kernels/capi:libdetlogp_ops_cuda.so needs nvcc)"
        )
    try:
        ops.load_cuda_library()
    except RuntimeError as error:  # e.g. no CUDA runtime on this machine
        pytest.skip(str(error))
    cuda_key = ops.determinism_key(model.weight_bits, model.bias, model.vocab, device="cuda")
    cpu_key = ops.determinism_key(model.weight_bits, model.bias, model.vocab)
    assert cuda_key.startswith("dk1-") and len(cuda_key) == 36
    assert cuda_key != cpu_key
    other = model.weight_bits.copy()
    other[0, 0] ^= 1
    assert ops.determinism_key(other, model.bias, model.vocab, device="cuda") != cuda_key


def test_entropy_is_the_float64_entropy_and_leaves_logprobs_alone(model):
    hidden, targets = model.random_rows(9, seed=808)
    plain = ops.linear_logp(hidden, model.weight_bits, targets, model.bias, vocab_size=model.vocab)
    logp, lse, entropy = ops.linear_logp(
        hidden,
        model.weight_bits,
        targets,
        model.bias,
        vocab_size=model.vocab,
        return_lse=True,
        return_entropy=True,
    )
    assert same_bits(logp, plain)
    logp2, entropy2 = ops.linear_logp(
        hidden, model.weight_bits, targets, model.bias, vocab_size=model.vocab, return_entropy=True
    )
    assert same_bits(entropy, entropy2) and same_bits(logp2, plain)
    want, _, _ = model.reference_entropy_top_k(hidden, 1)
    np.testing.assert_allclose(entropy, want, rtol=1e-4, atol=1e-4)


def test_projection_grads_are_the_kernels_and_match_float64(projection):
    _, weight, _ = projection
    rng = np.random.default_rng(5)
    x = rng.standard_normal((37, ops.H3_IN_DIM)).astype(np.float32)
    dy = rng.standard_normal((37, ops.H3_OUT_DIM)).astype(np.float32)
    dx = ops.cpu_h3_projection_input_grad(dy, weight)
    dweight, dbias = ops.cpu_h3_projection_weight_grad(dy, x)
    np.testing.assert_allclose(dx, dy.astype(np.float64) @ weight, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dweight, dy.T.astype(np.float64) @ x, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dbias, dy.sum(axis=0, dtype=np.float64), rtol=1e-4, atol=1e-3)
    # Row keys fix the order: the same rows as two batches with their keys
    # give the same bits only through the accumulator; one batch is
    # deterministic across thread counts.
    again, _ = ops.cpu_h3_projection_weight_grad(dy, x, num_threads=1)
    assert same_bits(again, dweight)
    assert ops.cpu_h3_projection_weight_grad(dy, x, with_bias=False)[1] is None


def test_a_missing_library_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(libraries, "_lib", None)
    monkeypatch.setenv(ops.LIBRARY_ENV, str(tmp_path / "nothing.so"))
    with pytest.raises(RuntimeError, match="DETLOGP_OPS_LIBRARY.*does not exist"):
        ops.load_library()
    # An installation without the library (DETLOGP_BUILD_OPS=0), outside
    # the repository.
    monkeypatch.delenv(ops.LIBRARY_ENV)
    monkeypatch.setattr(libraries, "PACKAGE_LIB_DIR", tmp_path / "_lib")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="libdetlogp_ops.so.*pip install ./client/python"):
        ops.linear_logp(
            np.zeros((1, 4), np.float32), np.zeros((8, 4), np.float32), np.zeros(1, np.int64)
        )


def test_the_package_imports_without_loading_the_library(tmp_path):
    env = dict(os.environ, **{ops.LIBRARY_ENV: str(tmp_path / "nothing.so")})
    out = subprocess.run(
        [sys.executable, "-c", "import detlogp, detlogp.ops"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


_INSTALLED_LIBRARY_SCRIPT = """
import sys
import numpy as np
from detlogp import ops
folder = sys.argv[1]
print(ops.find_library())
arrays = {name: np.load(f"{folder}/{name}.npy") for name in
          ("hidden", "targets", "weight", "bias", "x", "proj_weight", "proj_bias")}
vocab = int(sys.argv[2])
logp, lse, entropy = ops.linear_logp(
    arrays["hidden"], arrays["weight"], arrays["targets"], arrays["bias"], 0.9,
    vocab_size=vocab, return_lse=True, return_entropy=True)
np.save(f"{folder}/logp.npy", logp)
np.save(f"{folder}/lse.npy", lse)
np.save(f"{folder}/entropy.npy", entropy)
np.save(f"{folder}/y.npy", ops.h3_projection(
    arrays["x"], arrays["proj_weight"], arrays["proj_bias"]))
print(ops.determinism_key(arrays["weight"], arrays["bias"], vocab))
"""


def test_the_installed_library_gives_the_servers_bits(
    tmp_path, client, model, plain_client, projection, ops_library
):
    """`pip install ./client/python` compiles libdetlogp_ops.so into the
    package with the system compiler: outside the repository, with no
    variable set, detlogp.ops loads it and gets the CPU server's bits (and the
    Bazel-built library's)."""
    hidden, targets = model.random_rows(37, seed=909)
    x = np.random.default_rng(910).standard_normal((5, ops.H3_IN_DIM)).astype(np.float32)
    _, proj_weight, proj_bias = projection
    arrays = {
        "hidden": hidden,
        "targets": targets,
        "weight": model.weight_bits,
        "bias": model.bias,
        "x": x,
        "proj_weight": proj_weight,
        "proj_bias": proj_bias,
    }
    for name, array in arrays.items():
        np.save(tmp_path / f"{name}.npy", array)
    env = {k: v for k, v in os.environ.items() if k != ops.LIBRARY_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _INSTALLED_LIBRARY_SCRIPT, str(tmp_path), str(model.vocab)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    library, key = out.stdout.split()
    assert library == str(libraries.PACKAGE_LIB_DIR / "libdetlogp_ops.so"), (
        "the installed package has no ops library: install it with "
        "`pip install ./client/python` (tools/test_python.sh does)"
    )
    want = client.logprobs(hidden, targets, temperature=0.9, return_lse=True)
    assert same_bits(np.load(tmp_path / "logp.npy"), want.logprobs)
    assert same_bits(np.load(tmp_path / "lse.npy"), want.lse)
    # Entropy (not served by this request) against the Bazel-built library.
    bazel = ops.linear_logp(
        hidden, model.weight_bits, targets, model.bias, 0.9, model.vocab, return_entropy=True
    )
    assert same_bits(np.load(tmp_path / "entropy.npy"), bazel[1])
    assert same_bits(np.load(tmp_path / "y.npy"), plain_client.project(x, timeout=60).y)
    assert key == client.info().determinism_key


def test_the_sdist_carries_every_source_the_cpu_library_needs(repo_root, tmp_path):
    """A wheel built from the sdist alone (no repository around it) finds the
    CPU library's sources in ops_src/: every translation unit, and every
    project header they include, transitively."""
    import re
    import tarfile

    package = repo_root / "client" / "python"
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
        cwd=package,
        env=dict(os.environ, DETLOGP_BUILD_OPS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (archive,) = tmp_path.glob("detlogp-*.tar.gz")
    with tarfile.open(archive) as tar:
        files = {
            name.split("/ops_src/", 1)[1]: tar.extractfile(name).read().decode()
            for name in tar.getnames()
            if "/ops_src/" in name and tar.getmember(name).isfile()
        }
    sources = re.findall(r'^    "([a-z0-9_/]+\.cc)":', (package / "setup.py").read_text(), re.M)
    assert len(sources) >= 10 and all(s in files for s in sources), sorted(files)
    todo, seen = list(sources), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for include in re.findall(r'^#include "([^"]+)"', files[name], re.M):
            if not (repo_root / include).exists():
                continue  # a system library's (Abseil)
            assert include in files, f"{name} includes {include}, missing from the sdist"
            todo.append(include)
