"""The scan's ONNX export: both forms pass the checker, record their versions, and the standard form
run by ONNX Runtime from the exported file agrees with the NumPy reference."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scan_cases import CASE, check_against_reference, make_logits
from prepos_build import scan_onnx
from prepos_build.scan_onnx import DOMAIN, DOMAIN_VERSION, OPSET, PLUGIN_NAME, build_scan_model, export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("scan_onnx")
    assert scan_onnx.main(["--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def sessions(exported):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {dtype: ort.InferenceSession(str(exported / f"scan_standard_{dtype}.onnx"), options,
                                        providers=["CPUExecutionProvider"])
            for dtype in ("float32", "float16")}


def test_manifest_records_opset_domain_and_files(exported):
    manifest = json.loads((exported / "scan_onnx.json").read_text())
    assert manifest["opset"] == OPSET == 17
    assert manifest["domains"] == {DOMAIN: DOMAIN_VERSION} == {"prepos": 1}
    assert manifest["plugin"] == {"name": "VocabScan", "namespace": "prepos", "version": "1"}
    assert sorted(manifest["files"]) == sorted(f"scan_{f}_{d}.onnx" for f in ("standard", "plugin")
                                               for d in ("float32", "float16"))
    for name, info in manifest["files"].items():
        model = onnx.load(exported / name)
        onnx.checker.check_model(model)
        imports = {o.domain: o.version for o in model.opset_import}
        assert imports[""] == OPSET
        assert (DOMAIN in imports) == (info["form"] == "plugin")
        assert model.graph.input[0].type.tensor_type.elem_type == scan_onnx.DTYPES[info["dtype"]]
        assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "vocab"
        assert [i.name for i in model.graph.input] == list(scan_onnx.INPUT_NAMES)
        assert [o.name for o in model.graph.output] == list(scan_onnx.OUTPUT_NAMES)


def test_plugin_form_is_one_node_the_tensorrt_parser_maps_to_the_plugin_with_no_bool_input():
    model = build_scan_model("plugin")
    cast, node = model.graph.node
    assert (node.op_type, node.domain) == (PLUGIN_NAME, DOMAIN)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"plugin_namespace": b"prepos", "plugin_version": b"1"}
    # TensorRT plugins take no bool tensors: the model's bool mask reaches the plugin as int32.
    assert (cast.op_type, list(cast.input), list(cast.output)) == ("Cast", ["mask"], [node.input[1]])
    assert onnx.helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.INT32
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.input, *inferred.graph.value_info]}
    assert types[node.input[1]] == onnx.TensorProto.INT32
    assert onnx.TensorProto.BOOL not in [types[name] for name in node.input]
    assert types["mask"] == onnx.TensorProto.BOOL and [i.name for i in model.graph.input] == list(scan_onnx.INPUT_NAMES)


def test_standard_form_uses_standard_operators_only():
    model = build_scan_model("standard")
    nodes = list(model.graph.node)
    for node in model.graph.node:  # the If branches too
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes += list(attr.g.node)
    assert all(n.domain in ("", "ai.onnx") for n in nodes)
    schemas = {n.op_type: onnx.defs.get_schema(n.op_type, OPSET, "") for n in nodes}
    assert all(s.since_version <= OPSET for s in schemas.values())
    assert "If" in schemas and "TopK" in schemas


def test_bad_form_or_dtype_is_refused():
    with pytest.raises(ValueError, match="form"):
        build_scan_model("fused")
    with pytest.raises(ValueError, match="dtype"):
        build_scan_model("standard", "bfloat16")
    with pytest.raises(SystemExit):
        scan_onnx.main(["--output", "x", "--dtype", "int8"])


def test_an_output_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    with pytest.raises(SystemExit) as exited:
        scan_onnx.main(["--output", str(taken)])
    assert exited.value.code == 2 and f"--output: {taken} exists and is not a folder" in capsys.readouterr().err
    assert taken.read_text() == "not a folder"
    # one that cannot be made: under a file, or in /proc (a traceback)
    for out, problem in ((taken / "onnx", f"cannot make {taken / 'onnx'}: {taken} is not a folder"),
                         ("/proc/prepos-onnx", "cannot make /proc/prepos-onnx in /proc")):
        with pytest.raises(SystemExit) as exited:
            scan_onnx.main(["--output", str(out)])
        assert exited.value.code == 2 and f"--output: {problem}" in capsys.readouterr().err


def _run(session, logits, mask, temperature, top_k, top_p, u):
    token, p_max, margin, entropy = session.run(None, {
        "logits": logits, "mask": mask, "temperature": np.array([temperature], np.float32),
        "top_k": np.array([top_k], np.int64), "top_p": np.array([top_p], np.float32),
        "uniform": np.array([u], np.float32)})
    return int(token[0]), float(p_max[0]), float(margin[0]), float(entropy[0])


@settings(max_examples=50, deadline=None)
@given(dtype=st.sampled_from(["float32", "float16"]), **CASE)
def test_exported_standard_form_agrees_with_reference(sessions, vocab, seed, dtype, ties, masked, temperature,
                                                      top_k, top_p, u):
    logits, allowed = make_logits(vocab, seed, ties, masked, dtype)
    mask = np.zeros(vocab, bool)
    mask[allowed if masked else slice(None)] = True
    kw = dict(allowed_ids=allowed, temperature=temperature, top_k=top_k, top_p=top_p, uniform=u)
    check_against_reference(logits, kw, _run(sessions[dtype], logits, mask, temperature, top_k, top_p, u))


def test_onnx_runtime_cannot_run_the_plugin_form_without_the_plugin():
    with pytest.raises(Exception, match="VocabScan"):
        ort.InferenceSession(build_scan_model("plugin").SerializeToString(), providers=["CPUExecutionProvider"])


def test_export_subset_of_dtypes(tmp_path):
    path = export(tmp_path, ("float16",))
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == ["scan_plugin_float16.onnx", "scan_standard_float16.onnx"]
    assert json.loads(path.read_text())["opset"] == OPSET


def _session(sampling_head: int):
    model = build_scan_model("standard", "float32", sampling_head=sampling_head)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(20, 600), seed=st.integers(0, 2**31 - 1), ties=st.booleans(), masked=st.booleans(),
       temperature=st.sampled_from([0.3, 1.0, 3.0, 30.0]), top_k=st.sampled_from([0, 0, 5, 300]),
       top_p=st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.999]), u=st.floats(0.0, 0.999999))
def test_a_sampled_answer_found_in_the_head_is_the_whole_sorts(head_sessions, vocab, seed, ties, masked, temperature,
                                                                top_k, top_p, u):
    # A head of 16 tokens: the cut or the draw falls in it or past it, every way, and the answer is the same.
    logits, allowed = make_logits(vocab, seed, ties, masked, "float32")
    mask = np.zeros(vocab, bool)
    mask[allowed if masked else slice(None)] = True
    outputs = [_run(session, logits, mask, temperature, top_k, top_p, u) for session in head_sessions]
    if not math.isnan(outputs[0][1]):  # NaN: no finite allowed logit, an error whatever the token
        assert outputs[0] == outputs[1] == outputs[2], outputs
    if u <= 0.999:  # the reference's check, as for the graph itself (past it, float32 tail sums decide)
        kw = dict(allowed_ids=allowed, temperature=temperature, top_k=top_k, top_p=top_p, uniform=u)
        check_against_reference(logits, kw, outputs[1])


@pytest.fixture(scope="module")
def head_sessions():
    return [_session(0), _session(16), _session(4096)]


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_large_vocabularies_sample_as_the_whole_sort_does(head_sessions, vocab):
    rng = np.random.default_rng(vocab)
    logits = (rng.normal(0, 4, vocab)).astype(np.float32)
    mask = np.ones(vocab, bool)
    for temperature in (0.5, 1.0, 2.0):
        for top_p in (1.0, 0.9):
            for u in (0.0, 0.3, 0.999):
                full, _, default = (_run(session, logits, mask, temperature, 0, top_p, u) for session in head_sessions)
                assert default == full, (temperature, top_p, u)


def test_a_negative_sampling_head_is_refused():
    with pytest.raises(ValueError, match="sampling_head"):
        build_scan_model("standard", sampling_head=-1)
