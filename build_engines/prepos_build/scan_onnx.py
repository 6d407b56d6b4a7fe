"""The vocabulary scan as an ONNX graph, in two forms.

Both forms have one interface (``V`` is the dynamic vocabulary axis ``vocab``):

| input | type | meaning |
| --- | --- | --- |
| ``logits`` | float32 or float16 ``[V]`` | the cached next-token logits |
| ``mask`` | bool ``[V]`` | allowed tokens (a ``choices`` trie node); all true without choices |
| ``temperature`` | float32 ``[1]`` | 0 = greedy; > 0 samples |
| ``top_k`` | int64 ``[1]`` | 0 = no cut |
| ``top_p`` | float32 ``[1]`` | 1 = no cut |
| ``uniform`` | float32 ``[1]`` | the uniform draw in [0, 1) a sampled answer inverts; ignored when greedy |

| output | type | meaning |
| --- | --- | --- |
| ``token_id`` | int64 ``[1]`` | the answer token |
| ``p_max``, ``margin``, ``entropy`` | float32 ``[1]`` | the gate's features over the allowed tokens at temperature 1 |

The semantics are those of ``prepos.scan`` (the NumPy reference), computed in
float32: greedy is the allowed token with the largest logit, lowest id on ties
(``TopK`` documents the lower index first among equal values; one ``TopK`` of 2
yields the answer and both logits the features need); sampling tempers the
allowed logits, sorts by probability descending with ids ascending on ties, cuts
to ``top_k`` then to the smallest prefix whose mass reaches
``top_p``, and inverts the cumulative mass at ``uniform``. Sampling sits in an
``If`` branch, so a greedy scan never pays the sort; with no top-k cut it takes
the :data:`SAMPLING_HEAD` most likely tokens first and sorts the whole
vocabulary only where the cut or the draw falls past them (the same sums decide
either way). With no finite allowed logit
``p_max`` is NaN; callers turn that into an error, as the reference does.

- **standard** form: ONNX operators only (opset :data:`OPSET`); ONNX Runtime runs
  it on CPU (``prepos.scan_onnxruntime``).
- **plugin** form: one node ``VocabScan`` in domain :data:`DOMAIN` (version
  :data:`DOMAIN_VERSION`) carrying ``plugin_namespace``/``plugin_version``
  attributes, which TensorRT's ONNX parser maps to the plugin
  ``prepos::VocabScan`` (``prepos_build.scan_tensorrt``), after a ``Cast`` of the
  mask to int32 (TensorRT plugins take no bool tensors); the model's inputs are
  the standard form's.

``python -m prepos_build.scan_onnx --output DIR`` writes both forms for both
logit dtypes and ``scan_onnx.json``, which records opset and domain versions.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger(__name__)

OPSET = 17
DOMAIN = "prepos"
DOMAIN_VERSION = 1
PLUGIN_NAME = "VocabScan"
PLUGIN_VERSION = "1"
PLUGIN_MASK = "mask_int32"  # the plugin node's mask input: the model's bool mask cast to int32
IR_VERSION = 8  # readable by ONNX Runtime and TensorRT 10's parser alike
VOCAB_AXIS = "vocab"
INPUT_NAMES = ("logits", "mask", "temperature", "top_k", "top_p", "uniform")
OUTPUT_NAMES = ("token_id", "p_max", "margin", "entropy")
FORMS = ("standard", "plugin")
DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
MANIFEST = "scan_onnx.json"
_INT64_MAX = np.iinfo(np.int64).max
SAMPLING_HEAD = 4096
"""A sampled answer with no top-k cut looks in this many most likely tokens first (one TopK, not a sort of the
vocabulary), and sorts the whole vocabulary only where top_p's cut or the draw falls past them."""


def _const(name: str, value: Any, dtype: Any) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype=dtype), name))


def _io(dtype: str) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown logits dtype {dtype!r}; use {' or '.join(DTYPES)}")
    inputs = [
        helper.make_tensor_value_info("logits", DTYPES[dtype], [VOCAB_AXIS]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, [VOCAB_AXIS]),
        helper.make_tensor_value_info("temperature", TensorProto.FLOAT, [1]),
        helper.make_tensor_value_info("top_k", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("top_p", TensorProto.FLOAT, [1]),
        helper.make_tensor_value_info("uniform", TensorProto.FLOAT, [1]),
    ]
    outputs = [helper.make_tensor_value_info("token_id", TensorProto.INT64, [1])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in OUTPUT_NAMES[1:]]
    return inputs, outputs


def _branch(nodes: list[onnx.NodeProto], name: str, output: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.INT64, [1])])


def _draw(p: str, size: str) -> list[onnx.NodeProto]:
    """The draw over ``p + "sorted"``, the ``size`` most likely tokens' probabilities in the contract's order (TopK's,
    of ``s_qn``): node outputs are prefixed with ``p`` (the nodes stand in more than one branch), among them
    ``index_raw`` (how many of the kept tokens' cumulative masses are at most the draw's target), ``index`` (the
    drawn position, at most the last kept), ``num_pos`` (positive probabilities) and ``cumn`` (the cumulative
    mass, normalised). Reads the outer scope (see _sampling_branch)."""
    n = helper.make_node
    return [
        # top_p cut: keep = 1 + #(normalised cumulative mass < top_p), only when top_p < 1
        n("CumSum", [p + "sorted", "axis0_scalar"], [p + "cum"]),
        n("ReduceSum", [p + "sorted", "axis0"], [p + "cut_sum"], keepdims=1),
        n("Where", ["s_uncut", "s_mass", p + "cut_sum"], [p + "mass"]),  # the same sum on every path, uncut
        n("Div", [p + "cum", p + "mass"], [p + "cumn"]),
        n("Less", [p + "cumn", "top_p"], [p + "below"]),
        n("Cast", [p + "below"], [p + "below_i"], to=TensorProto.INT64),
        n("ReduceSum", [p + "below_i", "axis0"], [p + "num_below"], keepdims=1),
        n("Add", [p + "num_below", "one_i"], [p + "keep_p"]),
        n("Where", ["s_p_cut", p + "keep_p", size], [p + "keep_cut"]),
        # never past the last positive probability (masked tokens are never answers), nor so past the size
        n("Greater", [p + "sorted", "zero_f"], [p + "pos"]),
        n("Cast", [p + "pos"], [p + "pos_i"], to=TensorProto.INT64),
        n("ReduceSum", [p + "pos_i", "axis0"], [p + "num_pos"], keepdims=1),
        n("Max", [p + "num_pos", "one_i"], [p + "num_pos1"]),
        n("Min", [p + "keep_cut", p + "num_pos1"], [p + "keep"]),
        # invert the kept mass at uniform: index = #(cumulative <= u * total), capped at keep - 1; the total is
        # the kept prefix's cumulative mass, or (uncut, no top_p) the vocabulary's sum, the same on every path
        n("Slice", [p + "cum", "zero_i", p + "keep", "axis0"], [p + "cum2"]),
        n("Slice", [p + "cum2", "minus_one_i", "int64_max", "axis0"], [p + "kept_total"]),
        n("Where", ["s_whole", "s_mass", p + "kept_total"], [p + "total2"]),
        n("Mul", ["uniform", p + "total2"], [p + "target"]),
        n("LessOrEqual", [p + "cum2", p + "target"], [p + "le"]),
        n("Cast", [p + "le"], [p + "le_i"], to=TensorProto.INT64),
        n("ReduceSum", [p + "le_i", "axis0"], [p + "index_raw"], keepdims=1),
        n("Sub", [p + "keep", "one_i"], [p + "last"]),
        n("Min", [p + "index_raw", p + "last"], [p + "index"]),
    ]


def _full_sampling(p: str) -> onnx.GraphProto:
    """The draw over the top ``s_k`` tokens in the contract's order (a whole sort with no top-k cut). Node outputs
    are prefixed with ``p``: the graph is used in two branches."""
    n = helper.make_node
    nodes = [
        n("TopK", ["s_qn", "s_k"], [p + "sorted", p + "order"], axis=0, largest=1, sorted=1),
        *_draw(p, "s_k"),
        n("Gather", [p + "order", p + "index"], [p + "id"], axis=0),
    ]
    return _branch(nodes, p + "sample", p + "id")


def _head_sampling(head: int) -> onnx.GraphProto:
    """The draw from the ``head`` most likely tokens (no top-k cut, vocabulary larger than the head), where the
    cut and the draw both fall inside them; else the whole sort. TopK puts equal values in index order, so the
    head is the whole order's first ``head`` entries, and the sums of the draw are the whole path's: the answer
    does not depend on which path found it."""
    n = helper.make_node
    nodes = [
        _const("h_size", [head], np.int64),
        n("TopK", ["s_qn", "h_size"], ["h_sorted", "h_order"], axis=0, largest=1, sorted=1),
        *_draw("h_", "h_size"),
        n("Less", ["h_num_pos", "h_size"], ["h_all_pos"]),  # every positive probability is in the head
        # top_p: decided in the head when its cumulative share reaches top_p
        n("Slice", ["h_cumn", "minus_one_i", "int64_max", "axis0"], ["h_cumn_last"]),
        n("GreaterOrEqual", ["h_cumn_last", "top_p"], ["h_p_inside"]),
        # decided: with top_p, its cut inside the head; without, the draw inside it (or no token past it)
        n("Less", ["h_index_raw", "h_size"], ["h_draw_inside"]),
        n("Or", ["h_draw_inside", "h_all_pos"], ["h_no_p_decided"]),
        n("And", ["s_p_cut", "h_p_inside"], ["h_p_decided"]),
        n("And", ["s_no_p_cut", "h_no_p_decided"], ["h_no_p_decided_here"]),
        n("Or", ["h_p_decided", "h_no_p_decided_here"], ["h_decided_1"]),
        n("Squeeze", ["h_decided_1"], ["h_decided"]),
        n("If", ["h_decided"], ["h_id"],
          then_branch=_branch([n("Gather", ["h_order", "h_index"], ["h_found"], axis=0)], "head", "h_found"),
          else_branch=_full_sampling("w_")),
    ]
    return _branch(nodes, "sample_head", "h_id")


def _sampling_branch(head: int) -> onnx.GraphProto:
    # Reads the outer scope: shifted [V] (allowed logits minus their max, -inf where masked),
    # vocab [1], temperature, top_k, top_p, uniform, zero_i, one_i, zero_f, one_f.
    n = helper.make_node
    nodes = [
        n("Div", ["shifted", "temperature"], ["s_z"]),
        n("Exp", ["s_z"], ["s_q"]),
        n("ReduceSum", ["s_q", "axis0"], ["s_qsum"], keepdims=1),
        n("Div", ["s_q", "s_qsum"], ["s_qn"]),  # q: [V], 0 where masked
        n("ReduceSum", ["s_qn", "axis0"], ["s_mass"], keepdims=1),  # the uncut mass, one sum for every path
        # top_k cut: 0 < top_k < V keeps top_k, otherwise all
        n("Greater", ["top_k", "zero_i"], ["s_k_pos"]),
        n("Less", ["top_k", "vocab"], ["s_k_small"]),
        n("And", ["s_k_pos", "s_k_small"], ["s_k_cut"]),
        n("Not", ["s_k_cut"], ["s_uncut"]),
        n("Where", ["s_k_cut", "top_k", "vocab"], ["s_k"]),
        n("Less", ["top_p", "one_f"], ["s_p_cut"]),
        n("Not", ["s_p_cut"], ["s_no_p_cut"]),
        n("And", ["s_uncut", "s_no_p_cut"], ["s_whole"]),  # no cut at all: the draw is over the whole mass
    ]
    if head:  # the head first where nothing cuts the vocabulary to fewer tokens than it holds
        nodes += [
            _const("s_head", [head], np.int64),
            n("Greater", ["vocab", "s_head"], ["s_big"]),
            n("And", ["s_uncut", "s_big"], ["s_use_head_1"]),
            n("Squeeze", ["s_use_head_1"], ["s_use_head"]),
            n("If", ["s_use_head"], ["sampled_id"], then_branch=_head_sampling(head),
              else_branch=_full_sampling("f_")),
        ]
    else:
        nodes += [*_full_sampling("f_").node, n("Identity", ["f_id"], ["sampled_id"])]
    return _branch(nodes, "sample", "sampled_id")


def _standard_graph(dtype: str, sampling_head: int) -> onnx.GraphProto:
    inputs, outputs = _io(dtype)
    n = helper.make_node
    # x: [V] float32 (a float32 input is used as is)
    to_float = n("Cast", ["logits"], ["x"], to=TensorProto.FLOAT)
    cast = n("Identity", ["logits"], ["x"]) if dtype == "float32" else to_float
    nodes = [
        cast,
        _const("axis0", [0], np.int64),
        _const("axis0_scalar", 0, np.int64),
        _const("zero_i", [0], np.int64),
        _const("one_i", [1], np.int64),
        _const("minus_one_i", [-1], np.int64),
        _const("int64_max", [_INT64_MAX], np.int64),
        _const("two_i", [2], np.int64),
        _const("zero_f", [0.0], np.float32),
        _const("one_f", [1.0], np.float32),
        _const("neg_inf", [-np.inf], np.float32),
        _const("lowest_f", [np.finfo(np.float32).min], np.float32),
        n("Where", ["mask", "x", "neg_inf"], ["allowed"]),  # allowed: [V], -inf where masked
        n("Shape", ["allowed"], ["vocab"]),
        # one pass finds the answer and the two largest logits: TopK puts the lower id first on ties
        n("Min", ["vocab", "two_i"], ["k2"]),
        n("TopK", ["allowed", "k2"], ["top2", "top2_ids"], axis=0, largest=1, sorted=1),
        n("Slice", ["top2", "zero_i", "one_i", "axis0"], ["top"]),
        n("Slice", ["top2_ids", "zero_i", "one_i", "axis0"], ["greedy_id"]),
        # features at temperature 1 over the allowed tokens, from e = exp(x - top) and total = sum(e):
        # p_max = 1 / total, margin = (1 - exp(second - top)) / total,
        # entropy = log(total) - sum(e * (x - top)) / total (two non-negative terms: no cancellation)
        n("Sub", ["allowed", "top"], ["shifted"]),
        n("Exp", ["shifted"], ["e"]),
        n("ReduceSum", ["e", "axis0"], ["total"], keepdims=1),
        n("Reciprocal", ["total"], ["p_max"]),
        n("Concat", ["top2", "neg_inf"], ["top2_padded"], axis=0),  # second = -inf with one token
        n("Slice", ["top2_padded", "one_i", "two_i", "axis0"], ["second"]),
        n("Sub", ["second", "top"], ["second_shifted"]),
        n("Exp", ["second_shifted"], ["second_ratio"]),
        n("Sub", ["one_f", "second_ratio"], ["gap"]),
        n("Mul", ["gap", "p_max"], ["margin"]),
        n("Max", ["shifted", "lowest_f"], ["shifted_finite"]),  # e = 0 there: 0 * lowest = 0, not NaN
        n("Mul", ["e", "shifted_finite"], ["e_shifted"]),
        n("ReduceSum", ["e_shifted", "axis0"], ["e_shifted_sum"], keepdims=1),
        n("Mul", ["e_shifted_sum", "p_max"], ["mean_shifted"]),
        n("Log", ["total"], ["log_total"]),
        n("Sub", ["log_total", "mean_shifted"], ["entropy_raw"]),
        n("Max", ["entropy_raw", "zero_f"], ["entropy"]),
        # answer: greedy, or sampled in a branch that only a positive temperature pays
        n("Greater", ["temperature", "zero_f"], ["sampling"]),
        n("If", ["sampling"], ["token_id"], then_branch=_sampling_branch(sampling_head),
          else_branch=helper.make_graph([n("Identity", ["greedy_id"], ["greedy_out"])], "greedy", [],
                                        [helper.make_tensor_value_info("greedy_out", TensorProto.INT64, [1])])),
    ]
    return helper.make_graph(nodes, f"prepos_vocab_scan_{dtype}", inputs, outputs)


def _plugin_graph(dtype: str) -> onnx.GraphProto:
    inputs, outputs = _io(dtype)
    # TensorRT plugins take no bool tensors (PluginTensorDesc: kBOOL unsupported): the mask enters as int32.
    cast = helper.make_node("Cast", ["mask"], [PLUGIN_MASK], name="mask_to_int32", to=TensorProto.INT32)
    node = helper.make_node(
        PLUGIN_NAME, [PLUGIN_MASK if name == "mask" else name for name in INPUT_NAMES], list(OUTPUT_NAMES),
        name="vocab_scan", domain=DOMAIN, plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION,
    )
    return helper.make_graph([cast, node], f"prepos_vocab_scan_plugin_{dtype}", inputs, outputs)


def build_scan_model(form: str = "standard", dtype: str = "float32",
                     sampling_head: int = SAMPLING_HEAD) -> onnx.ModelProto:
    """The scan as an ONNX model of ``form`` (``standard`` or ``plugin``) for ``dtype`` logits; a sampled answer
    of the standard form looks in the ``sampling_head`` most likely tokens first (0: sorts at once).

    The model passes ``onnx.checker.check_model``; the standard form also passes
    full shape inference. Raises ``ValueError`` naming ``form`` or ``dtype``.
    """
    if form not in FORMS:
        raise ValueError(f"form: unknown scan graph form {form!r}; use {' or '.join(FORMS)}")
    if sampling_head < 0:
        raise ValueError(f"sampling_head: must be >= 0, got {sampling_head}")
    graph = _standard_graph(dtype, sampling_head) if form == "standard" else _plugin_graph(dtype)
    opsets = [helper.make_opsetid("", OPSET)]
    if form == "plugin":
        opsets.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="prepos_build", ir_version=IR_VERSION)
    model.doc_string = f"prepos vocabulary scan ({form} form, {dtype} logits)"
    onnx.checker.check_model(model, full_check=form == "standard")
    return model


def export(output: str | Path, dtypes: tuple[str, ...] = tuple(DTYPES)) -> Path:
    """Write ``scan_<form>_<dtype>.onnx`` for both forms and each dtype, and the manifest; returns its path."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for form in FORMS:
        for dtype in dtypes:
            name = f"scan_{form}_{dtype}.onnx"
            onnx.save_model(build_scan_model(form, dtype), out / name)
            files[name] = {"form": form, "dtype": dtype}
            log.info("wrote %s", out / name)
    manifest = {
        "onnx_version": onnx.__version__,
        "ir_version": IR_VERSION,
        "opset": OPSET,
        "domains": {DOMAIN: DOMAIN_VERSION},
        "plugin": {"name": PLUGIN_NAME, "namespace": DOMAIN, "version": PLUGIN_VERSION},
        "inputs": list(INPUT_NAMES),
        "outputs": list(OUTPUT_NAMES),
        "files": files,
    }
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prepos_build.scan_onnx",
                                description="Export the vocabulary scan as ONNX models (standard and plugin forms).")
    p.add_argument("--output", required=True, help="directory for the .onnx files and " + MANIFEST)
    p.add_argument("--dtype", choices=sorted(DTYPES), action="append",
                   help="logits dtype to export (repeatable; default: all)")
    args = p.parse_args(argv)
    from prepos.launch_checks import unusable_folder

    problem = unusable_folder(Path(args.output))  # a file in the way, /proc, no permission: before any export
    if problem:
        p.error(f"--output: {problem}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    path = export(args.output, tuple(args.dtype) if args.dtype else tuple(DTYPES))
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
