"""The gRPC connection every prepos client object opens: tritonclient's, reconnecting within half a second."""

from __future__ import annotations

import os
import random
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import tritonclient.grpc as grpcclient
from tritonclient.grpc import KeepAliveOptions
from tritonclient.utils import InferenceServerException

RECONNECT_BACKOFF_MAX_MS = 500
"""The longest pause between two attempts to reconnect to a server that went away. gRPC's default grows to two
minutes, so a client whose server was down for half a minute went on failing, unable to connect, for another
quarter of a minute after the server was back (measured: 16 s after a 30 s restart)."""

RECONNECT_BACKOFF_FIRST_MS = 100
"""The pause before the second attempt to reconnect (gRPC's default: one second)."""

WAIT_FIRST_S = 0.05
"""The first pause of a call waiting for its server to be ready again; doubled after each look."""
WAIT_MAX_S = 0.5
"""The longest pause between two looks at the server's readiness."""

_MAX_MESSAGE_BYTES = 2**31 - 1  # tritonclient's own limit, which a channel_args list replaces with gRPC's 4 MiB


def channel_args() -> list[tuple[str, int | bool]]:
    """tritonclient's default channel arguments (message size, keepalive) with the reconnect backoff capped."""
    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_FIRST_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    ]


_PORT = re.compile(r":(\d+)$")
_NAMED_PORT = re.compile(r"^([A-Za-z0-9.\-]+):([^:/\[\]]*)$")  # host:word, where gRPC wants a port number
_GRPC_SCHEMES = ("unix", "unix-abstract", "vsock", "ipv4", "ipv6", "dns")  # gRPC target names ending host:word


def check_url(url: str) -> str:
    """Return ``url`` if it can be a gRPC address: a non-empty string whose port, where it ends in one
    (``host:port``), is in 1-65535 (gRPC would wrap a larger one around onto another port).

    Raises:
        TypeError: not a str.
        ValueError: empty, or a port out of range.
    """
    if not isinstance(url, str):
        raise TypeError(f"url: expected host:port as a str, got {url!r}")
    if not url.strip():
        raise ValueError("url: empty; expected host:port")
    scheme = url.split("://", 1)[0].lower() if "://" in url else None
    if scheme in ("http", "https", "grpc", "grpcs"):
        address = url.split("://", 1)[1].split("/", 1)[0] or "host:8001"
        hint = f"{address} say"
        if scheme.startswith("http"):  # an HTTP URL names the HTTP port, if any: the gRPC one is another
            host = address.rsplit(":", 1)[0] if _PORT.search(address) else address
            hint = f"{host}:8001 by default, not its HTTP port"
        raise ValueError(f"url: {url!r} is a URL; expected a gRPC address, host:port (the server's gRPC port, {hint})")
    port = _PORT.search(url)
    if port is not None and not 0 < int(port.group(1)) < 65536:
        raise ValueError(f"url: port {port.group(1)} of {url!r} is not in 1-65535")
    named = _NAMED_PORT.match(url)
    if port is None and named is not None and named.group(1).lower() not in _GRPC_SCHEMES:
        try:
            socket.getservbyname(named.group(2))  # a service name (https) is a port too, to gRPC's resolver
        except OSError:
            raise ValueError(f"url: port {named.group(2)!r} of {url!r} is neither a number nor a service "
                             "name") from None
    return url


def check_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """``headers`` as a dict, if every name and value is a str (gRPC would refuse another at the first call).

    Raises:
        TypeError: not a mapping, or a name or value that is not a str (named).
    """
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise TypeError(f"headers: expected a mapping of str to str, got {type(headers).__name__}")
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"headers: {name!r}: expected str names and values, got {value!r}")
    return dict(headers)


_MAX_PEM_BYTES = 16 << 20  # more than any bundle of roots
_PEM_BEGINS = {  # the PEM blocks gRPC reads for each: certificates, and unencrypted PKCS#8, PKCS#1 or SEC1 keys
    "root_certificates": ("CERTIFICATE", re.compile(rb"-----BEGIN (TRUSTED )?CERTIFICATE-----\s*$")),
    "certificate_chain": ("CERTIFICATE", re.compile(rb"-----BEGIN (TRUSTED )?CERTIFICATE-----\s*$")),
    "private_key": ("PRIVATE KEY", re.compile(rb"-----BEGIN ((RSA|EC) )?PRIVATE KEY-----\s*$")),
}


def is_readable_file(path: str) -> bool:
    """Whether ``path`` names a file this process can read (a certificate, a key)."""
    return os.path.isfile(path) and os.access(path, os.R_OK)


@dataclass(frozen=True)
class Tls:
    """gRPC over TLS: the server's certificate is checked against ``root_certificates`` (a PEM file; None: the
    system's roots); ``private_key`` and ``certificate_chain`` (PEM files, both or neither) are the client's own,
    for servers that ask for one. ``server_name`` is the name the certificate must carry where it is not the
    address's host (a port-forward to ``localhost``, say).

    Raises:
        ValueError: a file that cannot be read or holds no PEM of its kind, a key without a chain (or a chain
            without a key), an empty server_name.
    """

    root_certificates: str | None = None
    private_key: str | None = None
    certificate_chain: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        for name, (label, begin) in _PEM_BEGINS.items():
            path = getattr(self, name)
            if path is None:
                continue
            if not is_readable_file(path):
                raise ValueError(f"tls.{name}: no readable file at {path!r}")
            with open(path, "rb") as f:
                found = any(begin.match(line) for line in f.read(_MAX_PEM_BYTES).splitlines())
            if not found:  # gRPC would say only that it cannot connect
                raise ValueError(f"tls.{name}: {path!r} holds no PEM {label.lower()} (-----BEGIN ...{label}-----)")
        if self.server_name is not None and not self.server_name.strip():
            raise ValueError("tls.server_name: empty; give the name the server's certificate carries, or None")
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("tls: private_key and certificate_chain go together (the client's certificate)")


def tls_of(tls: bool | Tls | None) -> Tls | None:
    """``tls`` as the clients take it: True is TLS with the system's roots, False or None plain text."""
    if tls is True:
        return Tls()
    if tls is None or tls is False or isinstance(tls, Tls):
        return tls or None
    raise TypeError(f"tls: expected a bool or a Tls, got {tls!r}")


def triton_client(url: str, tls: Tls | None = None) -> grpcclient.InferenceServerClient:
    """A tritonclient gRPC client for ``url`` (host:port) with :func:`channel_args`, over TLS where ``tls`` is
    given."""
    if tls is None:
        return grpcclient.InferenceServerClient(url, channel_args=channel_args())
    args = channel_args()
    if tls.server_name:
        args.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpcclient.InferenceServerClient(url, ssl=True, root_certificates=tls.root_certificates,
                                            private_key=tls.private_key, certificate_chain=tls.certificate_chain,
                                            channel_args=args)


def wait_until_ready(triton: grpcclient.InferenceServerClient, model: str, headers: Mapping[str, str] | None,
                     deadline: float, waits: int, keep_waiting: Callable[[float], bool] | None = None) -> bool:
    """Wait, until ``deadline`` (perf_counter time), for the server to report ``model`` ready, the ``waits``-th
    time for one call. Pauses grow from :data:`WAIT_FIRST_S` to :data:`WAIT_MAX_S` (jittered, so that waiting
    sessions spread out), so that a draining server is not asked in a tight loop. ``keep_waiting``, asked after
    each pause with the seconds left, ends the wait early when it says no (a routed session with somewhere else to
    go). Returns whether the server reported ready."""
    pause = min(WAIT_FIRST_S * 2 ** min(waits, 16), WAIT_MAX_S)
    while True:
        left_s = deadline - time.perf_counter()
        if left_s <= 0:
            return False
        time.sleep(min(pause * random.uniform(0.5, 1.0), left_s))
        pause = min(pause * 2, WAIT_MAX_S)
        if keep_waiting is not None and not keep_waiting(deadline - time.perf_counter()):
            return False
        left_s = deadline - time.perf_counter()
        if left_s <= 0:
            return False
        try:
            if triton.is_model_ready(model, headers=headers, client_timeout=min(left_s, 1.0)):
                return True
        except InferenceServerException:
            pass  # not reachable yet


def stop_stream(triton: grpcclient.InferenceServerClient, *, cancel_requests: bool) -> None:
    """``triton.stop_stream``, and on a cancel the end of the stream's request iterator too. tritonclient cancels the
    call but leaves the iterator without its end, so gRPC's thread that takes requests from it waits for one more
    forever: a thread and its stack per cancelled stream (55 threads and 3 MB for 200 sessions, about a quarter of
    them cancelled, in a churn test). The iterator ends at a None (tritonclient's own end of a stream it stops
    without a cancel); a second None changes nothing."""
    stream = getattr(triton, "_stream", None)
    triton.stop_stream(cancel_requests=cancel_requests)
    requests = getattr(stream, "_request_queue", None)
    if cancel_requests and requests is not None:
        requests.put(None)
