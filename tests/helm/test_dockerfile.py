# docker/Dockerfile is not built by these tests: building it needs a Docker engine and NVIDIA's base image.
"""The production image's Dockerfile agrees with the chart and the model repository."""

from __future__ import annotations

import ast
import importlib.util
import json
import posixpath
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / "docker" / "Dockerfile.dockerignore"
CHART_VALUES = REPO_ROOT / "helm" / "prepos" / "values.yaml"
MODEL_CONFIG = REPO_ROOT / "model_repository" / "prepos" / "config.pbtxt"
IMAGE_MODEL_REPOSITORY = "/opt/prepos/model_repository"
IMAGE_SOURCE = "/opt/prepos/src"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    pairs = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def kept_in_context() -> set[str]:
    """The paths the build context's filter lets through (its ``!path`` lines)."""
    return {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}


def arguments(keyword: str) -> list[str]:
    return [rest for kw, rest in instructions() if kw == keyword]


def test_base_is_the_triton_trtllm_container_with_a_tag_argument():
    pairs = instructions()
    assert pairs[0] == ("ARG", "TRITON_TAG=25.01")
    assert arguments("FROM") == ["nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3"]


def test_project_installed_without_dependencies_the_base_provides():
    (install,) = [run for run in arguments("RUN") if "/opt/prepos/src" in run]
    first = install.split("&&")[0]
    assert "pip install" in first and "--no-deps" in first
    assert "torch" not in install



def test_the_build_checks_that_the_base_provides_torch_and_openai_triton():
    checks = [run for run in arguments("RUN") if "import" in run]
    assert any("torch" in run and "triton" in run for run in checks)


def test_entrypoint_serves_the_copied_model_repository():
    (entrypoint,) = arguments("ENTRYPOINT")
    command = json.loads(entrypoint)
    assert command[command.index("tritonserver") + 1] == f"--model-repository={IMAGE_MODEL_REPOSITORY}"
    assert f"model_repository {IMAGE_MODEL_REPOSITORY}" in arguments("COPY")


def test_entrypoint_runs_tritonserver_under_the_supervisor_with_an_absolute_drain_file():
    from prepos.supervise import DRAIN_ENV, drain_file_from

    command = json.loads(arguments("ENTRYPOINT")[0])
    assert command[1:command.index("tritonserver")] == ["python3", "-m", "prepos.supervise", "--"]
    (env,) = [rest for rest in arguments("ENV") if rest.startswith(f"{DRAIN_ENV}=")]
    assert drain_file_from({DRAIN_ENV: env.partition("=")[2]}) is not None


def test_ports_match_the_chart_defaults():
    triton = yaml.safe_load(CHART_VALUES.read_text())["triton"]
    ports = {triton["httpPort"], triton["grpcPort"], triton["metricsPort"]}
    assert {int(p) for p in arguments("EXPOSE")[0].split()} == ports
    cmd = json.loads(arguments("CMD")[0])
    assert {int(arg.split("=")[1]) for arg in cmd} == ports


def test_default_engine_dir_of_the_model_resolves_to_the_chart_engine_dir():
    # config.pbtxt's engine.dir is relative to the model directory; in the image that lands on
    # the engine volume the chart mounts, at the directory the chart passes as PREPOS_ENGINE_DIR.
    values = yaml.safe_load(CHART_VALUES.read_text())
    match = re.search(r'key: "engine\.dir" value: \{ string_value: "([^"]+)" \}', MODEL_CONFIG.read_text())
    assert match, "engine.dir parameter not found in config.pbtxt"
    resolved = posixpath.normpath(posixpath.join(IMAGE_MODEL_REPOSITORY, "prepos", match.group(1)))
    assert resolved == values["prepos"]["engineDir"]
    assert resolved.startswith(values["storage"]["mountPath"] + "/")


def test_build_context_keeps_what_the_copies_need():
    kept = kept_in_context()
    sources = {rest.split()[0].rstrip("/") for rest in arguments("COPY")}
    assert sources <= kept


def test_the_images_install_step_builds_the_project_from_only_what_the_image_copies(tmp_path):
    # The image's `pip install /opt/prepos/src` sees only the COPY lines into that folder, through the
    # build context's filter; pyproject.toml names every package directory, and setuptools refuses to build
    # the project when one is missing (the image did not build while loadtest/ was left out).
    kept = kept_in_context()
    staged = tmp_path / "src"
    for copy in arguments("COPY"):
        source, destination = copy.split()
        if not destination.startswith(IMAGE_SOURCE + "/"):
            continue
        assert source.rstrip("/") in kept, f"{source} is filtered out of the build context"
        target = staged / destination[len(IMAGE_SOURCE) + 1:]
        if destination.endswith("/"):
            target = target / Path(source).name
        if (REPO_ROOT / source).is_dir():
            shutil.copytree(REPO_ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO_ROOT / source, target)
    # --ignore-requires-python as the image's own install: its Python (3.12) is not the development one
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--ignore-requires-python", "--wheel-dir", str(tmp_path / "wheel"), str(staged)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("prepos-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("prepos/serving.py", "prepos/supervise.py", "prepos/engines/cpu_kernels.c",
                   "prepos_client/__init__.py", "prepos_build/__main__.py", "prepos_loadtest/soak.py"):
        assert module in names, module


def test_the_images_python_sources_parse_as_3_10_and_import_nothing_3_12_removed():
    # The development interpreter is 3.11; NVIDIA's bases run 3.12 (25.01 on) or 3.10 (24.x), installed with
    # --ignore-requires-python: syntax new in 3.11 (`except*`, say) or a module 3.12 removed would fail at the
    # model's first import there.
    removed_in_3_12 = {"distutils", "imp", "asynchat", "asyncore", "smtpd"}
    roots = ["backend", "client", "build_engines", "loadtest/prepos_loadtest", "model_repository"]
    sources = [path for root in roots for path in (REPO_ROOT / root).rglob("*.py")]
    assert len(sources) > 50
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not {name.split(".")[0] for name in names} & removed_in_3_12, (path, names)


def _image_stack():
    spec = importlib.util.spec_from_file_location("image_stack", REPO_ROOT / "docker" / "image_stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_stacks_versions_are_of_the_base_the_dockerfile_names():
    # `make test-image-stack` runs the suite on the base's Python stack: a new default tag needs its versions.
    stack = _image_stack()
    assert ("ARG", f"TRITON_TAG={stack.TRITON_TAG}") == instructions()[0]


def test_the_image_stack_puts_the_images_versions_in_place_of_the_projects_pins():
    stack = _image_stack()
    requirements = stack.requirements()
    names = [stack._name(r) for r in requirements]
    assert len(names) == len(set(names)), "a package asked for twice"
    assert set(stack.IMAGE_VERSIONS.values()) <= set(requirements)
    # what the Dockerfile itself installs at a pinned version, the stack installs at that version too
    pins = {stack._name(word): word for run in arguments("RUN") for word in run.split() if "==" in word}
    asked = {stack._name(r): r for r in requirements}
    assert "gguf" in pins and all(asked[name] == pin for name, pin in pins.items() if name in asked), pins
    assert "triton" not in names  # installed after the others, without torch 2.6.0's wish for 3.2.0
    assert any(r.startswith("nvidia-pytriton") for r in requirements)  # the rest of the project's dependencies
    assert any(r.startswith("locust") for r in requirements)  # and its test tools
