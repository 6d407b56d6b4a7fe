"""tritonserver's command line: the values its flags are given, and the arguments prepos adds to it (threads for
Business Logic Scripting, keepalive pings, the shared-memory regions' prefix) or mends (an access token's
whitespace), for the launcher and :mod:`prepos.supervise`. Standard library only, as the supervisor."""

from __future__ import annotations

import logging

from prepos.shm_regions import PREFIX_OPTION, backend_config_argument, region_prefix

log = logging.getLogger("prepos.triton_args")

TRITON_EXIT_TIMEOUT_S = 30.0
"""tritonserver's ``--exit-timeout-secs`` when its arguments do not set it."""
TRITON_GRPC_PORT = 8001
"""tritonserver's ``--grpc-port`` when its arguments do not set it."""
TRITON_HTTP_PORT = 8000
"""tritonserver's ``--http-port`` when its arguments do not set it."""
KEEPALIVE_PING_ARGUMENTS = {
    "--grpc-keepalive-permit-without-calls": "1",
    "--grpc-http2-min-recv-ping-interval-without-data": "1000",
}
"""tritonserver's gRPC keepalive settings: a peer may ping a connection once a second, streams open or not.
gRPC's defaults count a ping that comes less than 5 minutes after the last one, while the server sends nothing, as
abuse, and close the connection at the third (GOAWAY ``too_many_pings``), so a proxy or client that keeps its
connection alive (Envoy's 30 s keepalive in the Helm chart) lost every session stream on it after about 90 s of
think time. A ping costs the server next to nothing."""
THREAD_POOL_OPTION = "thread-pool-size"
"""The Python backend's setting (``--backend-config=python,<it>=<n>``): its threads for Business Logic Scripting."""
BLS_THREADS = 288
"""The Python backend's threads for Business Logic Scripting calls, per model instance (Triton's default is 32).
Every request the HTTP bridge relays holds one of them until ``prepos`` answers it, and requests queued behind
another's answer in their session wait there too: with 32, 150 queued requests on one session held up every other
session's bridged request for 17-22 s. So there must be more of them than the bridge relays at once (its
``bridge.max_streams``, 256)."""


def _values(args: list[str], flag: str) -> list[str]:
    """The values of ``flag`` among tritonserver's arguments (``--flag=value`` or ``--flag value``), in order."""
    values = []
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            values.append(arg.partition("=")[2])
        elif arg == flag and i + 1 < len(args):
            values.append(args[i + 1])
    return values


def _last_value(args: list[str], flag: str) -> str | None:
    """The last value of ``flag`` (the one Triton keeps), else None."""
    values = _values(args, flag)
    return values[-1] if values else None


def exit_timeout_of(args: list[str]) -> float:
    """The ``--exit-timeout-secs`` among tritonserver's arguments, else Triton's default."""
    try:
        return float(_last_value(args, "--exit-timeout-secs") or TRITON_EXIT_TIMEOUT_S)
    except ValueError:
        return TRITON_EXIT_TIMEOUT_S


def grpc_port_of(args: list[str]) -> int:
    """The ``--grpc-port`` among tritonserver's arguments, else Triton's default."""
    return _port_of(args, "--grpc-port", TRITON_GRPC_PORT)


def http_port_of(args: list[str]) -> int:
    """The ``--http-port`` among tritonserver's arguments, else Triton's default."""
    return _port_of(args, "--http-port", TRITON_HTTP_PORT)


def _port_of(args: list[str], option: str, default: int) -> int:
    try:
        return int(_last_value(args, option) or default)
    except ValueError:
        return default  # tritonserver refuses it itself


def _python_setting(args: list[str], option: str) -> str | None:
    """The value tritonserver's ``args`` give the Python backend's ``option`` (``--backend-config=python,
    <option>=<value>``; the last one), else None."""
    setting = f"python,{option}="
    values = [value[len(setting):] for value in _values(args, "--backend-config") if value.startswith(setting)]
    return values[-1] if values else None


def configured_prefix(args: list[str]) -> str | None:
    """The Python backend's region prefix tritonserver's ``args`` set (the last one), else None."""
    return _python_setting(args, PREFIX_OPTION)


def bls_threads_argument(num_threads: int = BLS_THREADS) -> str:
    """tritonserver's argument that gives the Python backend ``num_threads`` threads for Business Logic Scripting."""
    return f"--backend-config=python,{THREAD_POOL_OPTION}={int(num_threads)}"


def with_bls_threads(args: list[str]) -> list[str]:
    """tritonserver's ``args`` with :data:`BLS_THREADS` threads for Business Logic Scripting, unless they set a
    number."""
    if _python_setting(args[1:], THREAD_POOL_OPTION) is not None:
        return args
    return [*args, bls_threads_argument()]


def keepalive_ping_arguments() -> list[str]:
    """tritonserver's arguments for :data:`KEEPALIVE_PING_ARGUMENTS`."""
    return [f"{flag}={value}" for flag, value in KEEPALIVE_PING_ARGUMENTS.items()]


def with_keepalive_pings(args: list[str]) -> list[str]:
    """tritonserver's ``args`` with :data:`KEEPALIVE_PING_ARGUMENTS` each, unless they set it."""
    return [*args, *(argument for argument in keepalive_ping_arguments()
                     if _last_value(args[1:], argument.partition("=")[0]) is None)]


def with_region_prefix(args: list[str]) -> tuple[list[str], str]:
    """tritonserver's ``args`` with the Python backend's shared-memory regions named after the gRPC port
    (:mod:`prepos.shm_regions`), unless they name them already; and their prefix."""
    prefix = configured_prefix(args[1:])
    if prefix:
        return args, prefix
    prefix = region_prefix(grpc_port_of(args[1:]))
    return [*args, backend_config_argument(prefix)], prefix


RESTRICTION_FLAGS = ("--grpc-restricted-protocol", "--http-restricted-api")


def with_tokens_trimmed(args: list[str]) -> list[str]:
    """tritonserver's ``args`` with the access token of each restriction (``FLAG=PROTOCOLS:HEADER=TOKEN``) taken
    without the whitespace around it, with a warning: the chart puts a Secret's value there as it is, and one made
    from a file ending in a newline made Triton want a header value no client can send (every call refused).
    Raises ValueError for a token that is empty, or blank."""
    trimmed = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        protocols, colon, setting = value.partition(":")
        header, eq2, token = setting.partition("=")
        if flag in RESTRICTION_FLAGS and eq and colon and eq2:
            if not token.strip():
                raise ValueError(f"{flag}: the access token for header {header!r} is empty (the Secret that holds "
                                 "it is empty, or its key is another)")
            if token != token.strip():
                log.warning("%s: the access token for header %r has whitespace around it (a Secret made from a file "
                            "that ends in a newline, say); it is taken without it", flag, header)
                arg = f"{flag}={protocols}:{header}={token.strip()}"
        trimmed.append(arg)
    return trimmed
