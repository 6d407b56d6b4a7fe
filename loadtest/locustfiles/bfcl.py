"""BFCL multi-turn tool routing: each user turn picks the next tool from a closed choice set.

    locust -f loadtest/locustfiles/bfcl.py --host 127.0.0.1:8001
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepos_loadtest.grpc_user import PreposUser  # noqa: E402


class BfclUser(PreposUser):
    workload = "bfcl"
