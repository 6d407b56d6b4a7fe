"""The ``prepos`` command (the console script): :func:`prepos_client.cli.main`, with gRPC's own log lines below
errors quieted. gRPC reads ``GRPC_VERBOSITY`` once, when it is imported, and otherwise logs at INFO: a failed TLS
handshake printed gRPC's ``I...`` line above the command's own message, which already says what failed. A
``GRPC_VERBOSITY`` the user set is kept; the one set here is removed again once gRPC is loaded, so that the
processes the command starts (``prepos serve``'s tritonserver) see the user's environment."""

from __future__ import annotations

import os


def main() -> int:
    if "GRPC_VERBOSITY" in os.environ:
        import grpc  # noqa: F401  (as the user's setting says)
    else:
        os.environ["GRPC_VERBOSITY"] = "ERROR"
        try:
            import grpc  # noqa: F401  (reads it now)
        finally:
            del os.environ["GRPC_VERBOSITY"]
    from prepos_client.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
