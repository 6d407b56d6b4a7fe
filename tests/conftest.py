import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "build_engines", "loadtest", "tests"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)
