"""prepos.shm_regions: the Python backend's shared-memory regions named after the server's port, and removed by
that prefix alone (the supervisor around it: test_supervise.py; a killed real server: test_crash_recovery.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prepos.launcher import ServerOptions, server_command
from prepos.shm_regions import (RemovedRegions, backend_config_argument, region_prefix, remove_left_regions,
                                remove_regions)
from prepos.supervise import configured_prefix


def test_only_the_regions_under_the_prefix_are_removed_and_counted(tmp_path):
    prefix = region_prefix(8001)
    ours = [tmp_path / f"{prefix}{name}" for name in ("a", "b")]
    theirs = [tmp_path / "prepos_80010_c", tmp_path / "triton_python_backend_shm_region_d", tmp_path / "prepos_8001"]
    for i, path in enumerate(ours + theirs):
        path.write_bytes(bytes(1000 * (i + 1)))
    assert remove_regions(prefix, tmp_path) == RemovedRegions(num_regions=2, num_bytes=1000 + 2000)
    assert not any(path.exists() for path in ours) and all(path.exists() for path in theirs)
    assert remove_regions(prefix, tmp_path) == RemovedRegions(0, 0)
    assert remove_regions(prefix, tmp_path / "absent") == RemovedRegions(0, 0)


def test_an_empty_prefix_is_refused_rather_than_naming_every_region(tmp_path):
    (tmp_path / "anything").write_bytes(b"x")
    with pytest.raises(ValueError, match="prefix"):
        remove_regions("", tmp_path)
    assert (tmp_path / "anything").exists()


def test_what_is_removed_is_logged_and_nothing_when_there_was_none(tmp_path, caplog):
    (tmp_path / "prepos_9_x").write_bytes(bytes(2_000_000))
    with caplog.at_level("INFO", logger="prepos.shm_regions"):
        remove_left_regions("prepos_9_", "a killed server", tmp_path)
        remove_left_regions("prepos_9_", "a killed server", tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        f"removed 1 shared-memory region(s) {tmp_path}/prepos_9_* (2.0 MB) left by a killed server"]


def test_the_launched_server_names_its_regions_after_its_grpc_port():
    command = server_command(ServerOptions(grpc_port=18123), Path("/b"))
    assert backend_config_argument("prepos_18123_") in command
    assert configured_prefix(command) == "prepos_18123_"


@pytest.mark.parametrize(("args", "expected"), [
    (["--backend-config=python,shm-region-prefix-name=a_"], "a_"),
    (["--backend-config", "python,shm-region-prefix-name=b_"], "b_"),
    (["--backend-config=python,shm-region-prefix-name=a_", "--backend-config=python,shm-region-prefix-name=c_"], "c_"),
    (["--backend-config=python,shm-default-byte-size=1048576"], None),
    (["--backend-config=onnxruntime,shm-region-prefix-name=x_"], None),  # another backend's setting
    ([], None),
])
def test_a_prefix_the_servers_arguments_set_is_found(args, expected):
    assert configured_prefix(args) == expected
