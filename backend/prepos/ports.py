"""The ports a prepos server listens on, and whether another process holds them already."""

from __future__ import annotations

import dataclasses
import errno
import socket


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One port the server listens on, and the launcher flag that sets it."""

    name: str  # HTTP, gRPC, metrics
    port: int
    flag: str  # --http-port


ENDPOINT_FIELDS = (("HTTP", "http_port"), ("gRPC", "grpc_port"), ("metrics", "metrics_port"))


def endpoints(options) -> tuple[Endpoint, ...]:
    """The server's endpoints; all three bind ``options.host`` (Triton's metrics address follows the HTTP one)."""
    return tuple(Endpoint(name, getattr(options, field), "--" + field.replace("_", "-"))
                 for name, field in ENDPOINT_FIELDS)


class PortInUseError(RuntimeError):
    """Ports the server is to listen on are held by another process."""

    def __init__(self, host: str, taken: tuple[Endpoint, ...], detail: str = ""):
        self.host = host
        self.taken = taken
        many = len(taken) > 1
        ports = ", ".join(f"{e.port} ({e.name}, {e.flag})" for e in taken)
        flags = " ".join(f"{e.flag} N" for e in taken)
        super().__init__(
            f"{'ports' if many else 'port'} {ports} on {host} {'are' if many else 'is'} already in use by another "
            f"process (another prepos or Triton server?): stop it, or move prepos to a free port with {flags} "
            f"(make serve SERVE_ARGS=\"{flags}\")" + (f"\n{detail}" if detail else ""))


def _port_taken(host: str, port: int) -> bool:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        return False  # an address that does not resolve is Triton's to report
    with socket.socket(family, kind, proto) as probe:
        # Servers set SO_REUSEADDR, and so does the probe: a port a stopped server left in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            return err.errno == errno.EADDRINUSE  # other bind errors (a foreign address, say) are Triton's to report
    return False


def taken_endpoints(options) -> tuple[Endpoint, ...]:
    """The endpoints whose port another socket already holds on ``options.host`` (checked by binding it)."""
    return tuple(e for e in endpoints(options) if _port_taken(options.host, e.port))
