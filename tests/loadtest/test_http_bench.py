"""The HTTP bridge benchmark's summary: medians, p99 and each way's median over gRPC's."""

from __future__ import annotations

import re
from pathlib import Path

import http_bench
import pytest


def test_each_way_is_summarized_against_grpc():
    ms = lambda *values: [v / 1e3 for v in values]  # noqa: E731
    times = {"grpc": ms(*range(1, 101)), "grpc_bridge": ms(*range(2, 202, 2)), "http_bridge": ms(3, 3, 3, 9)}
    result = http_bench.summarize(times)
    assert result["grpc"]["median_ms"] == 50.5 and result["grpc"]["p99_ms"] == 99.0
    assert result["grpc_bridge"]["median_over_grpc"] == 2.0 and result["grpc_bridge"]["requests"] == 100
    assert result["http_bridge"]["median_ms"] == 3.0 and result["http_bridge"]["p99_ms"] == 9.0
    table = http_bench.table(result, "test machine")
    assert "| grpc_bridge | 100 | 101.00 | 198.00 | 2.00 |" in table


def config_datatypes(model: str) -> dict[str, str]:
    """input name -> Triton datatype, from the model's config.pbtxt."""
    text = (Path(__file__).resolve().parents[2] / "model_repository" / model / "config.pbtxt").read_text()
    return {name: dtype for name, dtype in re.findall(r'name: "(\w+)" data_type: TYPE_(\w+)', text)}


@pytest.mark.parametrize(("bridge", "model"), [(False, "prepos"), (True, "prepos_http")])
def test_the_updates_inputs_have_the_datatypes_of_the_model_they_go_to(bridge, model):
    declared = config_datatypes(model)
    for start, end in ((True, False), (False, False), (False, True)):
        for name, value in http_bench.GrpcWay.inputs(bridge, "s", start, end).items():
            sent = http_bench.TRITON_DATATYPES[value.dtype.name]
            assert declared[name] == ("STRING" if sent == "BYTES" else sent), name
