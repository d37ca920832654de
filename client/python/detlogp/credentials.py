"""Channels with the server's security options: TLS roots (and a client
certificate for mutual TLS) and a bearer token sent on every call as
"authorization: Bearer <token>", unless the call carries its own
authorization (admin calls carry the admin token instead)."""

import collections

import grpc
import grpc.aio


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


def has_authorization(metadata):
    """True when call metadata already holds an authorization entry."""
    return any(key.lower() == "authorization" for key, _ in (metadata or ()))


def bearer(token):
    """Call metadata sending `token` as the call's only bearer token."""
    return (("authorization", f"Bearer {token}"),)


def _with_token(details, token):
    if has_authorization(details.metadata):
        return details
    metadata = list(details.metadata or []) + [("authorization", f"Bearer {token}")]
    return _CallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        details.wait_for_ready,
        getattr(details, "compression", None),
    )


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token):
        self._token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self._token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self._token), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(_with_token(details, self._token), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(_with_token(details, self._token), requests)


def _ssl(root_certificates, client_certificate, client_key):
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=client_key,
        certificate_chain=client_certificate,
    )


def make_channel(
    target, options, *, token=None, root_certificates=None, client_certificate=None, client_key=None
):
    """A sync channel; TLS when root_certificates (PEM bytes) are given."""
    if root_certificates is not None:
        channel = grpc.secure_channel(
            target, _ssl(root_certificates, client_certificate, client_key), options
        )
    else:
        channel = grpc.insecure_channel(target, options)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel


def make_aio_channel(
    target, options, *, root_certificates=None, client_certificate=None, client_key=None
):
    """An asyncio channel with make_channel's TLS options. It adds no token:
    asyncio calls carry theirs as call metadata, because an intercepted
    asyncio call hides the status that aio_status.ServerStatus watches."""
    if root_certificates is not None:
        return grpc.aio.secure_channel(
            target, _ssl(root_certificates, client_certificate, client_key), options
        )
    return grpc.aio.insecure_channel(target, options)
