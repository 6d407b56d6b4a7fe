import os
import sys
from pathlib import Path

import torch

# Without a GPU, OpenAI Triton kernels run under Triton's interpreter on CPU tensors (tests/core/test_scan_triton.py).
# Triton reads this once, when it is first imported: before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "client", "build_engines", "loadtest", "tests"):
    path = str(ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)
