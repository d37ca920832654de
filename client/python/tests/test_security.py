"""Bearer tokens and TLS from the Python clients, against the real server
started with --auth_tokens_file and a certificate made here with openssl."""

import asyncio
import subprocess

import detlogp
import grpc
import numpy as np
import pytest
from detlogp.testing import LocalServer


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    (folder / "tokens.txt").write_text("# test tokens\nsecret-one\nsecret-two\n")
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(folder / "key.pem"),
            "-out",
            str(folder / "cert.pem"),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return folder


@pytest.fixture(scope="module")
def secure_server(server_binary, model, secrets):
    with LocalServer(
        server_binary,
        model.flags
        + [
            f"--auth_tokens_file={secrets / 'tokens.txt'}",
            f"--tls_cert={secrets / 'cert.pem'}",
            f"--tls_key={secrets / 'key.pem'}",
            "--cpu_threads=1",
        ],
    ) as srv:
        yield srv


def _hidden(model):
    return np.random.default_rng(5).standard_normal((3, model.hidden), dtype=np.float32)


def test_token_and_tls_are_accepted(secure_server, secrets, model):
    roots = (secrets / "cert.pem").read_bytes()
    with detlogp.Client(
        secure_server.target, token="secret-two", root_certificates=roots, timeout=10
    ) as client:
        result = client.logprobs(_hidden(model), [1, 2, 3], return_lse=True)
        assert result.logprobs.shape == (3,)
        assert client.info().vocab_size == model.vocab
        assert client.health() == "SERVING"


@pytest.mark.parametrize("token", [None, "", "secret", "secret-one-x"])
def test_missing_or_wrong_tokens_are_unauthenticated(secure_server, secrets, model, token):
    roots = (secrets / "cert.pem").read_bytes()
    with detlogp.Client(
        secure_server.target,
        token=token,
        root_certificates=roots,
        timeout=10,
        retry=detlogp.NO_RETRY,
    ) as client:
        with pytest.raises(detlogp.Unauthenticated):
            client.logprobs(_hidden(model), [1, 2, 3])
        # Health stays open for probes.
        assert client.health() == "SERVING"


def test_async_client_sends_the_token(secure_server, secrets, model):
    roots = (secrets / "cert.pem").read_bytes()

    async def run():
        async with detlogp.aio.AsyncClient(
            secure_server.target, token="secret-one", root_certificates=roots, timeout=10
        ) as client:
            result = await client.logprobs(_hidden(model), [4, 5, 6])
            streamed = [r async for r in client.stream([(_hidden(model), [1, 2, 3])])]
            return result, streamed

    result, streamed = asyncio.run(run())
    assert result.logprobs.shape == (3,)
    assert len(streamed) == 1


def test_plaintext_client_cannot_reach_a_tls_server(secure_server, model):
    with detlogp.Client(
        secure_server.target, token="secret-one", timeout=3, retry=detlogp.NO_RETRY
    ) as client:
        with pytest.raises(detlogp.DetlogpError):
            client.logprobs(_hidden(model), [1, 2, 3])


def test_push_to_a_dns_name_checks_each_address_against_the_names_certificate(
    server_binary, model, secrets, monkeypatch
):
    """The servers listen on 127.0.0.2 and 127.0.0.3, which the certificate
    (localhost, 127.0.0.1) does not name: by address the push fails, through
    the name "localhost" resolved to them it reaches both."""
    from detlogp import dns_targets
    from detlogp.fleet import Pusher

    roots = (secrets / "cert.pem").read_bytes()
    flags = model.flags + [
        f"--admin_tokens_file={secrets / 'tokens.txt'}",
        f"--tls_cert={secrets / 'cert.pem'}",
        f"--tls_key={secrets / 'key.pem'}",
        "--cpu_threads=1",
    ]
    with (
        LocalServer(server_binary, flags + ["--host=127.0.0.2"]) as a,
        LocalServer(server_binary, flags + ["--host=127.0.0.3"]) as b,
    ):
        addresses = [f"127.0.0.2:{a.port}", f"127.0.0.3:{b.port}"]
        monkeypatch.setattr(
            dns_targets,
            "resolve_with_getaddrinfo",
            lambda host, port: addresses if host == "localhost" else [],
        )
        tls = dict(admin_token="secret-one", root_certificates=roots, timeout=20.0)
        with Pusher(addresses, **tls) as pusher:
            with pytest.raises(detlogp.DetlogpError) as by_address:
                pusher.upload_model("default", model.weight_bits, model.bias, model.vocab)
        assert all(
            error.code == grpc.StatusCode.UNAVAILABLE
            for error in by_address.value.per_target.values()
        )
        with Pusher("dns:///localhost:50051", **tls) as pusher:
            result = pusher.upload_model("default", model.weight_bits, model.bias, model.vocab)
        assert sorted(result.per_target) == addresses
        assert {s.version for s in result.per_target.values()} == {2}
