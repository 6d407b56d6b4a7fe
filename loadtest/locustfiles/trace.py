"""Replays the sessions of a JSONL trace file named by the environment variable PREPOS_TRACE.

    PREPOS_TRACE=chat.jsonl locust -f loadtest/locustfiles/trace.py --host 127.0.0.1:8001
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepos_loadtest.grpc_user import PreposUser  # noqa: E402
from prepos_loadtest.workloads import TraceFormatError, read_trace  # noqa: E402

if not os.environ.get("PREPOS_TRACE"):
    sys.exit("PREPOS_TRACE: set it to the JSONL trace file to replay")
# Read at start, so that a malformed file stops the run before any user starts.
try:
    TRACES = read_trace(os.environ["PREPOS_TRACE"])
except (OSError, TraceFormatError) as error:
    sys.exit(f"PREPOS_TRACE: {error}")


class TraceUser(PreposUser):
    @classmethod
    def load_traces(cls, options):
        return TRACES
