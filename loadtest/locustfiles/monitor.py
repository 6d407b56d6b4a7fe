"""Streaming monitor: sensor readings arrive as updates; a yes/no question is asked with an empty delta.

    locust -f loadtest/locustfiles/monitor.py --host 127.0.0.1:8001
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepos_loadtest.grpc_user import PreposUser  # noqa: E402


class MonitorUser(PreposUser):
    workload = "monitor"
