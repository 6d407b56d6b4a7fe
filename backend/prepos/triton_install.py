"""Where the Triton server of the nvidia-pytriton wheel lives, and the backend directory a launched server
loads its Python backend and this interpreter's stub from."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def pytriton_dir() -> Path:
    """The installed nvidia-pytriton package, which holds tritonserver, its Python backend and the stubs."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise SystemExit("nvidia-pytriton is not installed: run `make serve` (it installs everything into .venv)")
    return Path(spec.origin).parent


def prepare_backend_dir(run_dir: Path) -> Path:
    """Lay out ``run_dir/backends/python`` with the Python backend and the stub for this interpreter."""
    triton = pytriton_dir() / "tritonserver"
    stub = triton / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"no Triton Python backend stub for Python {PY_VERSION} in {stub.parent.parent}")
    python_dir = run_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in [*(triton / "backends" / "python").glob("*.*"), stub]:
        target = python_dir / source.name
        # Symlinks keep the stub's $ORIGIN-relative library path pointing into the wheel.
        if target.is_symlink() or target.exists():
            if target.is_symlink() and target.resolve() == source.resolve():
                continue
            target.unlink()
        target.symlink_to(source)
    return run_dir / "backends"
