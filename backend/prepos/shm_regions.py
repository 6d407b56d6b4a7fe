"""The Python backend's shared-memory regions: named per server, removed once that server is gone.

Triton's Python backend passes requests and responses between tritonserver and
each backend stub through POSIX shared memory: one file per region under
``/dev/shm`` (1 MiB at least, ``shm-default-byte-size``), which it unlinks when it
stops cleanly. A server that is killed (a crash, an OOM kill, or the kill that
follows a drained stop, :data:`prepos.supervise.ENDED_EXIT_S`) leaves its
regions behind, and nothing else removes them: on a machine they hold memory
until a reboot, in a container's in-memory ``/dev/shm`` until the pod goes.

So each server that ``make serve``'s launcher or :mod:`prepos.supervise` starts
names its regions with a prefix of its own, from its gRPC port
(:func:`region_prefix`), and the regions under that prefix are removed before
tritonserver starts (an earlier server's on that port, which is gone: the launcher
found the port free, and a container runs one server) and once tritonserver and
its stubs have exited. Unlinking a region a process still maps leaves the mapping
as it is. Standard library only: :mod:`prepos.supervise` imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("prepos.shm_regions")

SHM_DIR = Path("/dev/shm")
PREFIX_OPTION = "shm-region-prefix-name"
"""The Python backend's setting (``--backend-config=python,<it>=<prefix>``) that names its regions."""


@dataclass(frozen=True)
class RemovedRegions:
    num_regions: int
    num_bytes: int


def region_prefix(grpc_port: int) -> str:
    """The prefix of the regions of the server on ``grpc_port``."""
    return f"prepos_{int(grpc_port)}_"


def backend_config_argument(prefix: str) -> str:
    """tritonserver's argument that makes the Python backend name its regions ``<prefix><id>``."""
    return f"--backend-config=python,{PREFIX_OPTION}={prefix}"


def remove_regions(prefix: str, shm_dir: Path | None = None) -> RemovedRegions:
    """Unlink every region named ``<prefix>...`` in ``shm_dir`` (default :data:`SHM_DIR`); what could not be
    removed is left with a warning."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    if not prefix:
        raise ValueError("remove_regions needs a prefix (an empty one would name every region)")
    num_regions = num_bytes = 0
    try:
        paths = sorted(path for path in shm_dir.iterdir() if path.name.startswith(prefix))
    except OSError:  # no such directory: nothing to remove
        return RemovedRegions(0, 0)
    for path in paths:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue  # its server removed it meanwhile
        except OSError as err:
            log.warning("could not remove shared-memory region %s: %s", path, err)
            continue
        num_regions += 1
        num_bytes += size
    return RemovedRegions(num_regions, num_bytes)


def remove_left_regions(prefix: str, why: str, shm_dir: Path | None = None) -> RemovedRegions:
    """:func:`remove_regions`, logging what was removed (``why``: whose they were)."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    removed = remove_regions(prefix, shm_dir)
    if removed.num_regions:
        log.info("removed %d shared-memory region(s) %s* (%.1f MB) left by %s", removed.num_regions,
                 shm_dir / prefix, removed.num_bytes / 1e6, why)
    return removed
