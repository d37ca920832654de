"""Hugging Face checkpoint directories served as they are, against the real
CPU server: written the way save_pretrained writes them (one file; four
shards with model.safetensors.index.json; tied embeddings, top level and
under text_config; a bias; int64 buffers in the files), each served from the
directory through --weights, --model, LoadModel, the Python upload and
detlogp_cli upload with the bits of the same head given as a bare file; the
messages of every refusal; a new version of another shape refused with the
old one still serving.
"""

import json
import pathlib
import subprocess
import sys

import detlogp
import numpy as np
import pytest
from detlogp import checkpoint, safetensors_io, tensors
from detlogp.errors import FailedPrecondition
from detlogp.testing import LocalServer

HIDDEN = 64
VOCAB = 96
ROWS = 6


def _bf16(rng, *shape, scale=0.5):
    return tensors.float32_to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))


def _config(tied, where="top"):
    sizes = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "tie_word_embeddings": tied}
    if where == "text_config":
        return {"model_type": "llava", "text_config": sizes}
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **sizes}


class Checkpoint:
    """A checkpoint directory and the same head as a bare file."""

    def __init__(self, folder, name, *, layout, tied=False, where="top", bias=False, seed=0):
        rng = np.random.default_rng(seed)
        self.dir = pathlib.Path(folder) / name
        self.dir.mkdir()
        embedding_name = (
            "language_model.model.embed_tokens.weight"
            if where == "text_config"
            else "model.embed_tokens.weight"
        )
        embedding = _bf16(rng, VOCAB, HIDDEN)
        body = {
            embedding_name: embedding,
            "model.layers.0.mlp.up_proj.weight": _bf16(rng, 128, HIDDEN),
            "model.norm.weight": np.ones(HIDDEN, np.float32),
            "model.position_ids": np.arange(32, dtype=np.int64)[None, :],
        }
        head = {}
        if tied:
            self.weight = embedding
        else:
            self.weight = _bf16(rng, VOCAB, HIDDEN)
            head["lm_head.weight"] = self.weight
        self.bias = (rng.standard_normal(VOCAB) * 0.5).astype(np.float32) if bias else None
        if bias:
            head["lm_head.bias"] = self.bias
        if layout == "single":
            safetensors_io.write(self.dir / "model.safetensors", {**body, **head})
        else:  # four shards, the head in the third
            names = list(body)
            shards = [
                {names[0]: body[names[0]]},
                {names[1]: body[names[1]]},
                {**head, "model.position_ids": body["model.position_ids"]},
                {names[2]: body[names[2]]},
            ]
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-00004.safetensors"
                safetensors_io.write(self.dir / file, shard)
                weight_map.update(dict.fromkeys(shard, file))
            (self.dir / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
            )
        (self.dir / "config.json").write_text(json.dumps(_config(tied, where)))
        bare = {"lm_head.weight": self.weight}
        if bias:
            bare["lm_head.bias"] = self.bias
        self.bare = pathlib.Path(folder) / f"{name}_bare.safetensors"
        safetensors_io.write(self.bare, bare)

    @property
    def bare_flags(self):
        return f"{self.bare}:lm_head.weight"


LAYOUTS = {
    "single": dict(layout="single", seed=1),
    "sharded": dict(layout="sharded", seed=2),
    "tied": dict(layout="single", tied=True, seed=3),
    "tied_text_config": dict(layout="single", tied=True, where="text_config", seed=4),
    "bias": dict(layout="sharded", bias=True, seed=5),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def root(folder):
    path = folder / "root"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def checkpoints(root):
    """Every layout, written under the model root (LoadModel reads there)."""
    return {name: Checkpoint(root, name, **kwargs) for name, kwargs in LAYOUTS.items()}


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(99)
    return (
        rng.standard_normal((ROWS, HIDDEN)).astype(np.float32),
        rng.integers(0, VOCAB, size=ROWS),
    )


@pytest.fixture(scope="module")
def served(server_binary, checkpoints, root):
    """Each checkpoint as --model=<layout>=<dir> and its bare file as
    --model=<layout>_bare=<file>:lm_head.weight (bias through --bias_tensor
    only where there is one: a separate server for those)."""
    flags = []
    for name, ckpt in checkpoints.items():
        flags.append(f"--model={name}={ckpt.dir}")
        if ckpt.bias is None:
            flags.append(f"--model={name}_bare={ckpt.bare_flags}")
    with LocalServer(
        server_binary,
        flags + [f"--model_root={root}", "--max_versions_per_model=4", "--cpu_threads=1"],
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def bias_bare(server_binary, checkpoints):
    """The biased head as a bare file, bias named explicitly."""
    ckpt = checkpoints["bias"]
    with LocalServer(
        server_binary,
        [f"--weights={ckpt.bare}", "--bias_tensor=lm_head.bias", "--cpu_threads=1"],
    ) as srv:
        yield srv


def _score(target, rows, model=None, version=None):
    with detlogp.Client(target, timeout=20.0) as c:
        return c.logprobs(*rows, return_lse=True, model=model, version=version)


def _want(name, served, bias_bare, rows):
    """The bare file's answer for this layout."""
    if name == "bias":
        return _score(bias_bare.target, rows)
    return _score(served.target, rows, model=f"{name}_bare")


def _same_bits(got, want):
    assert got.logprobs.tobytes() == want.logprobs.tobytes()
    assert got.lse.tobytes() == want.lse.tobytes()
    assert got.determinism_key == want.determinism_key


# ---------------------------------------------------------------- readers
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_python_reader_finds_the_head(checkpoints, name):
    ckpt = checkpoints[name]
    head = checkpoint.resolve_head(ckpt.dir)
    want_tensor = {
        "tied": "model.embed_tokens.weight",
        "tied_text_config": "language_model.model.embed_tokens.weight",
    }.get(name, "lm_head.weight")
    assert head.weight_tensor == want_tensor
    assert head.tied == name.startswith("tied")
    assert (head.padded_vocab_size, head.hidden_size) == (VOCAB, HIDDEN)
    assert (head.bias_tensor is not None) == (ckpt.bias is not None)
    if LAYOUTS[name]["layout"] == "sharded":
        assert head.weight_file.endswith("model-00003-of-00004.safetensors")
    lm_head = detlogp.LmHead.from_checkpoint(ckpt.dir)
    assert lm_head.weight.tobytes() == ckpt.weight.tobytes()
    assert lm_head.sha256() == detlogp.lm_head_sha256(ckpt.weight, ckpt.bias)
    assert want_tensor in lm_head.source


def test_python_reader_messages(folder, checkpoints):
    empty = folder / "empty"
    empty.mkdir()
    with pytest.raises(
        checkpoint.CheckpointError, match="is a directory with no model.safetensors"
    ):
        checkpoint.resolve_head(empty)
    sharded = checkpoints["sharded"].dir
    with pytest.raises(
        checkpoint.CheckpointError,
        match="is a shard index; lm_head.weight is in model-00003-of-00004.safetensors",
    ):
        checkpoint.resolve_head(sharded / "model.safetensors.index.json")
    with pytest.raises(
        checkpoint.CheckpointError,
        match="this is one shard of a checkpoint: model.safetensors.index.json puts "
        "lm_head.weight in model-00003-of-00004.safetensors",
    ):
        checkpoint.resolve_head(sharded / "model-00001-of-00004.safetensors")
    untied = folder / "untied_no_head"
    untied.mkdir()
    safetensors_io.write(
        untied / "model.safetensors",
        {"model.embed_tokens.weight": np.zeros((VOCAB, HIDDEN), np.float32)},
    )
    (untied / "config.json").write_text(json.dumps(_config(False)))
    with pytest.raises(
        checkpoint.CheckpointError, match="no lm_head.weight and tie_word_embeddings is false"
    ):
        checkpoint.resolve_head(untied)


@pytest.mark.parametrize(("top", "text"), [(False, True), (True, False)])
def test_python_reader_takes_the_text_configs_tie_flag(folder, top, text):
    """A wrapper's top-level flag disagreeing with its text config's: the
    text config decides, as vLLM reads it."""
    embedding = "language_model.model.embed_tokens.weight"
    ckpt = folder / f"conflicting_tie_top_{top}_text_{text}"
    ckpt.mkdir()
    safetensors_io.write(
        ckpt / "model.safetensors", {embedding: np.zeros((VOCAB, HIDDEN), np.float32)}
    )
    config = {"model_type": "llava", "tie_word_embeddings": top, "text_config": _config(text)}
    (ckpt / "config.json").write_text(json.dumps(config))
    if text:
        head = checkpoint.resolve_head(ckpt)
        assert head.weight_tensor == embedding
        assert head.tied
    else:
        with pytest.raises(
            checkpoint.CheckpointError, match="no lm_head.weight and tie_word_embeddings is false"
        ):
            checkpoint.resolve_head(ckpt)


# ---------------------------------------------------------------- serving
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_flag_serves_the_bare_files_bits(served, bias_bare, rows, name):
    got = _score(served.target, rows, model=name)
    _same_bits(got, _want(name, served, bias_bare, rows))


def test_weights_flag_takes_a_sharded_directory(server_binary, checkpoints, served, rows):
    ckpt = checkpoints["sharded"]
    with LocalServer(server_binary, [f"--weights={ckpt.dir}", "--cpu_threads=1"]) as srv:
        _same_bits(_score(srv.target, rows), _score(served.target, rows, model="sharded_bare"))
        log = srv.log()
    # Which tensor of which shard, and its dtype.
    assert f"lm_head.weight (BF16 [{VOCAB}, {HIDDEN}]) in model-00003-of-00004.safetensors" in log


def test_tied_and_untied_side_by_side_each_serve_their_own_head(served, rows):
    tied = _score(served.target, rows, model="tied")
    untied = _score(served.target, rows, model="single")
    assert tied.logprobs.tobytes() != untied.logprobs.tobytes()
    _same_bits(tied, _score(served.target, rows, model="tied_bare"))
    _same_bits(untied, _score(served.target, rows, model="single_bare"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_load_model_of_a_directory(served, bias_bare, checkpoints, rows, name):
    with detlogp.Client(served.target, timeout=60.0) as c:
        published = c.load_model(f"loaded_{name}", name)
        want = _want(name, served, bias_bare, rows)
        assert published.weights_sha256 == detlogp.lm_head_sha256(
            checkpoints[name].weight, checkpoints[name].bias
        )
    _same_bits(_score(served.target, rows, model=f"loaded_{name}"), want)


@pytest.mark.parametrize("name", ["sharded", "tied", "bias"])
def test_python_upload_of_a_directory(served, bias_bare, checkpoints, rows, name):
    with detlogp.Client(served.target, timeout=60.0) as c:
        c.upload_model(f"uploaded_{name}", str(checkpoints[name].dir))
    got = _score(served.target, rows, model=f"uploaded_{name}")
    _same_bits(got, _want(name, served, bias_bare, rows))


def test_console_upload_of_a_directory(served, checkpoints, rows):
    ckpt = checkpoints["tied_text_config"]
    done = subprocess.run(
        [sys.executable, "-m", "detlogp.cli", "--target", served.target, "upload"]
        + ["console_tied", str(ckpt.dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "language_model.model.embed_tokens.weight" in done.stderr
    _same_bits(
        _score(served.target, rows, model="console_tied"),
        _score(served.target, rows, model="tied_text_config_bare"),
    )


def test_cli_upload_of_a_directory(served, bias_bare, checkpoints, rows, server_binary):
    cli = pathlib.Path(server_binary).parents[1] / "client" / "detlogp_cli"
    if not cli.exists():
        pytest.fail(f"{cli} is missing: bazel build //client:detlogp_cli", pytrace=False)
    for name, shard in [
        ("sharded", "model-00003-of-00004.safetensors"),
        ("bias", "model-00003-of-00004.safetensors"),
        ("tied", "model.safetensors"),
    ]:
        done = subprocess.run(
            [
                str(cli),
                "upload",
                f"--target={served.target}",
                f"--model=cli_{name}",
                f"--weights_file={checkpoints[name].dir}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert f" in {shard} of {checkpoints[name].dir}" in done.stderr
        _same_bits(
            _score(served.target, rows, model=f"cli_{name}"),
            _want(name, served, bias_bare, rows),
        )


# ---------------------------------------------------------------- refusals
def _start_fails(server_binary, args):
    """Runs the server expecting it to exit non-zero at once; its output."""
    done = subprocess.run(
        [str(server_binary), "--port=0", "--cpu_threads=1", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_start_up_refusals_say_what_happened(server_binary, folder, checkpoints):
    empty = folder / "empty_dir"
    empty.mkdir()
    sharded = checkpoints["sharded"].dir
    untied = folder / "untied_flag"
    untied.mkdir()
    safetensors_io.write(
        untied / "model.safetensors",
        {"model.embed_tokens.weight": np.zeros((VOCAB, HIDDEN), np.float32)},
    )
    (untied / "config.json").write_text(json.dumps(_config(False)))
    cases = [
        ([f"--weights={empty}"], "is a directory with no model.safetensors"),
        (
            [f"--weights={sharded}/model.safetensors.index.json"],
            "is a shard index; lm_head.weight is in model-00003-of-00004.safetensors",
        ),
        (
            [f"--weights={sharded}/model-00001-of-00004.safetensors"],
            "lm_head.weight in model-00003-of-00004.safetensors; pass the directory",
        ),
        ([f"--model=m={untied}"], "no lm_head.weight and tie_word_embeddings is false"),
        (
            [
                f"--weights={sharded}/model-00001-of-00004.safetensors",
                f"{sharded}/model-00002-of-00004.safetensors",
            ],
            "several files given",
        ),
        (
            [f"--model=m={sharded}", "--lm_head_tensor=model.embed_tokens.weight"],
            f"{sharded} has its own lm_head.weight; --lm_head_tensor=model.embed_tokens.weight "
            "(given for every --model) is not used in its place: name it for this model "
            f"to serve it (--model=m={sharded}:model.embed_tokens.weight)",
        ),
    ]
    for args, message in cases:
        output = _start_fails(server_binary, args)
        assert message in output, (args, output[-2000:])
        assert "serving" not in output.lower().replace("not serving", "")


@pytest.mark.parametrize(
    "flags",
    [
        # Each model names its own head (or none).
        ["--model=untied={single}", "--model=tied={tied}:model.embed_tokens.weight"],
        # --weights takes --lm_head_tensor; the --model beside it resolves alone.
        [
            "--weights={tied}",
            "--lm_head_tensor=model.embed_tokens.weight",
            "--model=untied={single}",
        ],
        # The older form (--lm_head_tensor for every --model, as deployments
        # pass the old default): each checkpoint still serves its own head.
        ["--model=untied={single}", "--model=tied={tied}", "--lm_head_tensor=lm_head.weight"],
    ],
)
def test_a_tensor_named_for_one_model_never_applies_to_another(server_binary, checkpoints, flags):
    single = checkpoints["single"]
    tied = checkpoints["tied"]
    args = [flag.format(single=single.dir, tied=tied.dir) for flag in flags]
    with LocalServer(server_binary, args + ["--cpu_threads=1"]) as srv:
        with detlogp.Client(srv.target) as c:
            assert c.info(model="untied").weights_sha256 == detlogp.lm_head_sha256(single.weight)
            tied_name = "default" if args[0].startswith("--weights") else "tied"
            assert c.info(model=tied_name).weights_sha256 == detlogp.lm_head_sha256(tied.weight)


def test_another_shape_is_refused_and_the_old_version_serves(served, checkpoints, root, rows):
    """Upload and LoadModel of a head with another hidden size or vocabulary
    as the next version of a serving model: FAILED_PRECONDITION naming the
    field and both values; the model keeps serving its bits."""
    before = _score(served.target, rows, model="single")
    rng = np.random.default_rng(5)
    wider = root / "wider.safetensors"
    safetensors_io.write(wider, {"lm_head.weight": _bf16(rng, VOCAB, HIDDEN + 8)})
    with detlogp.Client(served.target, timeout=60.0) as c:
        versions = [v.version for v in c.info(model="single").versions]
        with pytest.raises(FailedPrecondition) as refused:
            c.upload_model("single", _bf16(rng, VOCAB, HIDDEN + 8))
        assert refused.value.field == "header.hidden_size"
        assert f"serves hidden_size={HIDDEN}" in str(refused.value)
        assert f"hidden_size={HIDDEN + 8}" in str(refused.value)
        with pytest.raises(FailedPrecondition) as refused:
            c.upload_model("single", _bf16(rng, VOCAB + 8, HIDDEN))
        assert refused.value.field == "header.vocab_size"
        assert f"serves vocab_size={VOCAB}" in str(refused.value)
        with pytest.raises(FailedPrecondition) as refused:
            c.load_model("single", "wider.safetensors")
        assert refused.value.field == "hidden_size"
        assert [v.version for v in c.info(model="single").versions] == versions
    _same_bits(_score(served.target, rows, model="single"), before)


def test_readers_skip_tensors_they_do_not_read(folder):
    """An int64 buffer and a tensor of a dtype numpy has no type for (F8)
    sit beside the head: read() leaves the F8 one out, the head's readers
    never look at either."""
    path = folder / "mixed.safetensors"
    head = np.arange(VOCAB * HIDDEN, dtype=np.float32).reshape(VOCAB, HIDDEN) / 1e4
    safetensors_io.write(
        path, {"lm_head.weight": head, "model.position_ids": np.arange(4, dtype=np.int64)}
    )
    # Append an F8_E4M3 tensor by rewriting the header.
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    data = blob[8 + length :]
    header["model.scales"] = {
        "dtype": "F8_E4M3",
        "shape": [4],
        "data_offsets": [len(data), len(data) + 4],
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data + b"\0" * 4)

    read_back = safetensors_io.read(path)
    assert sorted(read_back) == ["lm_head.weight", "model.position_ids"]
    assert read_back["model.position_ids"].tolist() == [0, 1, 2, 3]
    lm_head = detlogp.LmHead.from_checkpoint(path)
    assert lm_head.weight.tobytes() == tensors.float32_to_bf16_bits(head).tobytes()
    with pytest.raises(checkpoint.CheckpointError, match="dtype I64 is not F32, BF16 or F16"):
        checkpoint.resolve_head(path, "model.position_ids")


def test_a_loaded_directory_is_restored_after_a_restart(server_binary, tmp_path, rows):
    """LoadModel of a checkpoint directory records it under --model_root; a
    restarted server resolves the directory again and serves the same bits."""
    root = tmp_path / "root"
    root.mkdir()
    ckpt = Checkpoint(root, "restored", layout="sharded", tied=False, seed=8)
    flags = [f"--model_root={root}", "--cpu_threads=1"]
    with LocalServer(server_binary, flags) as srv:
        with detlogp.Client(srv.target, timeout=60.0) as c:
            published = c.load_model("policy", "restored")
        assert published.weights_sha256 == detlogp.lm_head_sha256(ckpt.weight)
        before = _score(srv.target, rows, model="policy")
    with LocalServer(server_binary, flags) as srv:
        with detlogp.Client(srv.target) as c:
            info = c.info(model="policy")
        assert (info.model_version, info.weights_sha256) == (
            published.version,
            published.weights_sha256,
        )
        _same_bits(_score(srv.target, rows, model="policy"), before)
