"""Client library for prepos, the stateful LLM server on Triton.

    from prepos_client import Client

    with Client("127.0.0.1:8001") as client, client.session() as session:
        session.append("You answer in one word.", role="system")
        answer = session.ask("Is water wet?", choices=["yes", "no"])
        print(answer.text, answer.path, answer.ttft_ms)
"""

from .errors import PreposError, PreposTimeout, PreposUnavailable, parse_field
from .protocol import Answer, Chunk, Update, build_inputs, parse_chunk
from .channel import Tls
from .client import DEFAULT_MODEL, DEFAULT_URL, Client
from .session import SESSION_HEADER, Session
from .session_ids import new_session_id

__all__ = [
    "Answer",
    "Chunk",
    "Client",
    "DEFAULT_MODEL",
    "DEFAULT_URL",
    "PreposError",
    "PreposTimeout",
    "PreposUnavailable",
    "SESSION_HEADER",
    "Session",
    "Tls",
    "Update",
    "build_inputs",
    "new_session_id",
    "parse_chunk",
    "parse_field",
]
