"""HTTP bridge stress: clients that drop their requests mid-answer, round after round; the bridge must live through it.

Starts the real server (no journal) and runs ``--rounds`` rounds: ``--clients``
HTTP requests at once (every other one ``generate_stream``, the rest
``generate``; ``max_tokens`` 20), each connection closed 0.2-0.6 s after its
request went out, then, once their answers have run out, one request that must
be answered (200). Before the bridge's calls into its backend stub went one at
a time, 3 rounds in under 70 left the stub dead (``malloc(): unaligned fastbin chunk
detected``) and every later HTTP request refused; since, none in 120.

    python loadtest/http_drop_stress.py [--rounds 30] [--clients 16]

Exits 0 when every round's check was answered, 1 naming the first round that
was not (and the server log's last lines), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

from prepos.launcher import ServerOptions, TritonServer, interrupt_on_sigterm  # noqa: E402
from prepos_loadtest.repository import check_out_dir, free_loopback_ports  # noqa: E402

log = logging.getLogger("prepos.http_drop_stress")
SETTLE_S = 3.0  # after a round: the dropped requests' answers run to their end (20 tokens)


def drop(host: str, port: int, index: int) -> None:
    """Send one request and close the connection before its answer is complete."""
    stream = index % 2 == 0
    body = json.dumps({"text_input": f"Tell me about the number {index}.", "max_tokens": 20,
                       **({"stream": True} if stream else {})}).encode()
    path = f"/v2/models/prepos_http/{'generate_stream' if stream else 'generate'}"
    with socket.create_connection((host, port), timeout=30) as connection:
        connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.2 + (index % 5) * 0.1)


def check(host: str, port: int) -> tuple[int, str]:
    """One request that must be answered: (HTTP status, the start of the body)."""
    request = urllib.request.Request(f"http://{host}:{port}/v2/models/prepos_http/generate",
                                     data=json.dumps({"text_input": "Hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read(200).decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read(200).decode(errors="replace")
    except OSError as error:
        return 0, str(error)


def run(rounds: int, clients: int, run_dir: Path) -> int | None:
    """The first round whose check failed, or None."""
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    options = ServerOptions(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, run_dir=run_dir,
                            journal_dir="off")
    with TritonServer(options) as server:
        for number in range(1, rounds + 1):
            threads = [threading.Thread(target=drop, args=(options.host, http_port, i)) for i in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            time.sleep(SETTLE_S)
            status, text = check(options.host, http_port)
            log.info("round %d/%d: %d dropped, check answered %d", number, rounds, clients, status)
            if status != 200:
                log.error("round %d: the check was not answered: %d %s", number, status, text)
                log.error("server log (%s), last lines:\n%s", server.log_file,
                          "\n".join(Path(server.log_file).read_text(errors="replace").splitlines()[-15:]))
                return number
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="rounds of dropped requests (%(default)s)")
    p.add_argument("--clients", type=int, default=16, help="requests dropped per round (%(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "http_drop_stress")
    args = p.parse_args(argv)
    check_out_dir(p, args.out)  # before any server starts or anything is written
    if args.rounds < 1 or args.clients < 1:
        p.error("--rounds and --clients must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    interrupt_on_sigterm()  # a SIGTERM stops the server on the way out
    failed = run(args.rounds, args.clients, args.out / "run")
    if failed is not None:
        print(f"the bridge stopped answering after round {failed} of {args.rounds}")
        return 1
    print(f"the bridge answered after each of {args.rounds} rounds of {args.clients} dropped requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
