"""The access token that guards a prepos server's inference and control endpoints.

With ``--access-token-file FILE`` or the environment variable ``PREPOS_ACCESS_TOKEN``, Triton rejects every call
of the protocols in ``RESTRICTED_PROTOCOLS`` (inference and repository control included; health and metadata
stay open for probes) that does not carry the header ``prepos-access-token`` with the token: that name on HTTP,
and ``triton-grpc-protocol-prepos-access-token`` on gRPC (Triton prefixes restricted gRPC headers so). Triton
takes the token as a command-line argument, so whatever prints a command or a log line masks it first.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

ACCESS_TOKEN_ENV = "PREPOS_ACCESS_TOKEN"
ACCESS_TOKEN_HEADER = "prepos-access-token"
GRPC_ACCESS_TOKEN_HEADER = f"triton-grpc-protocol-{ACCESS_TOKEN_HEADER}"  # how gRPC clients must send it
RESTRICTED_PROTOCOLS = ("inference", "model-repository", "model-config", "shared-memory", "statistics", "trace",
                        "logging")
"""Triton protocol groups (gRPC) / APIs (HTTP) that need the access token; ``health`` and ``metadata`` stay open."""
MIN_TOKEN_LENGTH = 16
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")


log = logging.getLogger("prepos.launcher")


def resolve_access_token(options, environ: dict[str, str] | None = None) -> str | None:
    """The access token from ``options.access_token`` (a launcher's ``ServerOptions``), else its file, else ``PREPOS_ACCESS_TOKEN``; None when
    none is set. Raises ValueError (never showing the token) when it is unusable."""
    environ = os.environ if environ is None else environ
    if options.access_token:
        token, source = options.access_token, "access_token"
    elif options.access_token_file:
        try:
            token, source = Path(options.access_token_file).read_text().strip(), options.access_token_file
        except OSError as err:
            raise ValueError(f"access token file: {err.strerror or err} ({options.access_token_file})") from None
        if not token:
            raise ValueError(f"access token file {options.access_token_file} is empty")
    elif environ.get(ACCESS_TOKEN_ENV):  # blanks only: refused below, as a token of 0 characters
        token, source = environ[ACCESS_TOKEN_ENV].strip(), ACCESS_TOKEN_ENV
    else:
        if ACCESS_TOKEN_ENV in environ:  # set, but to nothing: most likely a secret that did not arrive
            log.warning("%s is set but empty: no access token, the endpoints are open", ACCESS_TOKEN_ENV)
        return None
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"access token from {source}: {len(token)} characters; use at least {MIN_TOKEN_LENGTH}")
    if not set(token) <= _TOKEN_CHARS:
        raise ValueError(f"access token from {source}: use only letters, digits and -._~+/= (base64 or hex)")
    return token


def restriction_arguments(token: str) -> list[str]:
    """Triton flags that require ``ACCESS_TOKEN_HEADER: token`` on the restricted protocols (gRPC and HTTP)."""
    restriction = f"{','.join(RESTRICTED_PROTOCOLS)}:{ACCESS_TOKEN_HEADER}={token}"
    return [f"--grpc-restricted-protocol={restriction}", f"--http-restricted-api={restriction}"]


def masked(text: str, token: str | None) -> str:
    """``text`` with the token replaced, for anything that is printed or logged."""
    return text.replace(token, "***") if token else text
