"""Multi-turn chat: free generation with a human's lognormal think time between turns.

    locust -f loadtest/locustfiles/chat.py --host 127.0.0.1:8001
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepos_loadtest.grpc_user import PreposUser  # noqa: E402


class ChatUser(PreposUser):
    workload = "chat"
