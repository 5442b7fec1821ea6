"""The artifacts write each big weight once (the inference model points into the checkpoint)
and hash no zeros (Adam's zero moments are a tail of the checkpoint the digest counts).

References: numpy (the model's output, the bytes of the weights), hashlib, onnxruntime and
``onnx.load`` reading the inference model as any user would."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.training import (
    Checkpoint,
    generate_artifacts,
    load_checkpoint,
    load_train_step,
    merge_checkpoint,
    save_checkpoint,
)
from onnxgrad.training.artifacts.checkpoint import save_tensors
from onnxgrad.training.artifacts.manifest import read_manifest
from onnxgrad.training.artifacts.shared_weights import SHARED_FROM

SIDE = 512  # one float32 weight of 1 MiB: shared; its 2 KiB bias is not
RNG = np.random.default_rng(0)
W = RNG.standard_normal((SIDE, SIDE)).astype(np.float32)
B = RNG.standard_normal(SIDE).astype(np.float32)
X = RNG.standard_normal((3, SIDE)).astype(np.float32)


def _model(scale_constant: bool = False) -> onnx.ModelProto:
    """``Y = (X @ W + b) * s``, ``s`` an initializer, or a ``Constant`` node (a weight
    that only the lowered model holds as an initializer)."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Mul", ["a", "s"], ["Y"]),
    ]
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "b")]
    scale = np.full(SIDE, 0.5, np.float32)
    if scale_constant:
        value = numpy_helper.from_array(scale)
        nodes.insert(0, helper.make_node("Constant", [], ["s"], value=value))
    else:
        inits.append(numpy_helper.from_array(scale, "s"))
    graph = helper.make_graph(
        nodes,
        "affine",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", SIDE])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", SIDE])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _external(path) -> dict[str, dict[str, str]]:
    model = onnx.load(path, load_external_data=False)
    return {
        init.name: {e.key: e.value for e in init.external_data}
        for init in model.graph.initializer
        if init.data_location == TensorProto.EXTERNAL
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared") / "art"
    generate_artifacts(_model(), artifact_directory=folder)
    return folder


def test_a_big_weight_is_written_once(folder):
    assert W.nbytes >= SHARED_FROM > B.nbytes
    inference = folder / "inference_model.onnx"
    assert inference.stat().st_size < W.nbytes // 100  # before: the weight's 1 MiB again
    assert _external(inference) == {
        "W": {"location": "checkpoint.bin", "offset": "0", "length": str(W.nbytes)}
    }
    assert (folder / "checkpoint.bin").read_bytes()[: W.nbytes] == W.tobytes()


def test_the_inference_model_reads_as_the_model_given(folder):
    loaded = onnx.load(folder / "inference_model.onnx")
    onnx.checker.check_model(str(folder / "inference_model.onnx"), full_check=True)
    values = {i.name: numpy_helper.to_array(i) for i in loaded.graph.initializer}
    np.testing.assert_array_equal(values["W"], W)
    np.testing.assert_array_equal(values["b"], B)
    session = ort.InferenceSession(
        str(folder / "inference_model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = (X.astype(np.float64) @ W + B) * 0.5
    np.testing.assert_allclose(session.run(None, {"X": X})[0], expected, rtol=1e-4, atol=1e-4)


def test_a_trained_checkpoint_merges_into_the_shared_model(folder, tmp_path):
    assert load_train_step(folder).weight_shapes["W"] == (SIDE, SIDE)
    trained = {"W": W * 2, "b": B + 1, "s": np.full(SIDE, 0.25, np.float32)}
    save_checkpoint(Checkpoint(weights=trained), tmp_path / "trained.json")
    merged = merge_checkpoint(folder, tmp_path / "trained.json")
    values = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    assert all(i.data_location != TensorProto.EXTERNAL for i in merged.graph.initializer)
    for name, value in trained.items():
        np.testing.assert_array_equal(values[name], value)


def test_the_artifacts_own_checkpoint_is_not_overwritten(folder):
    # the inference model reads W from checkpoint.bin: a trained checkpoint saved over it
    # would change that model silently (and break the folder's digests)
    before = (folder / "checkpoint.bin").read_bytes()
    trained = Checkpoint(weights={"W": W * 2, "b": B, "s": np.ones(SIDE, np.float32)})
    with pytest.raises(ValueError, match=r"checkpoint of the artifacts in .*elsewhere"):
        save_checkpoint(trained, folder / "checkpoint.json")
    with pytest.raises(ValueError, match=r"checkpoint of the artifacts in .*elsewhere"):
        save_tensors(trained.weights, folder / "checkpoint.json")
    assert (folder / "checkpoint.bin").read_bytes() == before
    load_train_step(folder)  # the folder still verifies


def test_a_checkpoint_without_a_shared_weight_is_refused_naming_it(folder, tmp_path):
    save_checkpoint(Checkpoint(weights={"b": B, "s": B}), tmp_path / "partial.json")
    with pytest.raises(ValueError, match=r"holds weights \['b', 's'\], the artifacts train"):
        merge_checkpoint(folder, tmp_path / "partial.json")


def _dense_copy(folder, tmp_path, changed: int | None = None):
    """A copy of the folder, its holes written as zeros, byte ``changed`` of the checkpoint's
    data flipped."""
    copy = tmp_path / "art"
    copy.mkdir()
    for path in folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    if changed is not None:
        data = bytearray((copy / "checkpoint.bin").read_bytes())
        data[changed] ^= 1
        (copy / "checkpoint.bin").write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("where", ["weight", "zero tail"])
def test_a_changed_byte_of_the_checkpoint_is_refused(folder, tmp_path, where):
    # inside W, which both the checkpoint and the model read; or the last byte of Adam's
    # zero moments, which no digest hashes
    size = (folder / "checkpoint.bin").stat().st_size
    copy = _dense_copy(folder, tmp_path, W.nbytes // 2 if where == "weight" else size - 1)
    with pytest.raises(ValueError, match=r"checkpoint\.bin.*does not match its digest"):
        read_manifest(copy)
    with pytest.raises(ValueError, match=r"checkpoint\.bin.*does not match its digest"):
        load_train_step(copy)
    if where == "weight":
        with pytest.raises(ValueError, match=r"checkpoint\.bin.*does not match its digest"):
            merge_checkpoint(copy, copy / "checkpoint.json")


def test_the_zero_moments_are_a_tail_the_digest_counts(folder, tmp_path):
    manifest = json.loads((folder / "artifacts.json").read_text())
    listed = manifest["files"]["checkpoint.bin"]
    entries = json.loads((folder / "checkpoint.json").read_text())["tensors"]
    state = [e for e in entries if e["name"].endswith(("_m", "_v"))]  # Adam's moments
    assert {e["name"] for e in state} == {f"{w}_{m}" for w in "Wbs" for m in "mv"}, entries
    data = (folder / "checkpoint.bin").read_bytes()
    tail = len(data) - listed["zeros"]
    assert listed["bytes"] == len(data) and listed["zeros"] >= 2 * W.nbytes
    assert all(e["offset"] >= tail for e in state)  # every zero moment in the tail
    assert hashlib.sha256(data[:tail]).hexdigest() == listed["sha256"]
    assert not any(data[tail:])
    loaded = load_checkpoint(folder / "checkpoint.json", mapped=True)
    assert all(not value.any() for value in loaded.optimizer_state.values() if value.size > 1)
    # the zeros written out (a copy without holes) read the same
    assert read_manifest(_dense_copy(folder, tmp_path))["files"] == manifest["files"]
    shutil.rmtree(tmp_path / "art")


def test_no_sharing_where_a_merge_rebuilds_the_model(tmp_path):
    # a weight held by a Constant node: the merge lowers the whole model, reading every
    # initializer's data, so the inference model keeps its own
    art = generate_artifacts(_model(scale_constant=True), artifact_directory=tmp_path / "art")
    assert _external(art.path("inference_model.onnx")) == {}
    trained = {"W": W * 2, "b": B + 1, "s": np.full(SIDE, 0.25, np.float32)}
    save_checkpoint(Checkpoint(weights=trained), tmp_path / "trained.json")
    merged = merge_checkpoint(art.directory, tmp_path / "trained.json")
    session = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = (X.astype(np.float64) @ trained["W"] + trained["b"]) * 0.25
    np.testing.assert_allclose(session.run(None, {"X": X})[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("claim", ["all zeros", "more than the file", "not a count"])
def test_a_forged_zero_tail_is_refused(folder, tmp_path, claim):
    # a forger rewrites the manifest: the zeros claimed are checked, not trusted
    copy = _dense_copy(folder, tmp_path)
    manifest = json.loads((copy / "artifacts.json").read_text())
    listed = manifest["files"]["checkpoint.bin"]
    zeros = {"all zeros": listed["bytes"], "more than the file": listed["bytes"] + 1}
    listed["zeros"] = zeros.get(claim, -1)
    if claim == "all zeros":
        listed["sha256"] = hashlib.sha256(b"").hexdigest()
    (copy / "artifacts.json").write_text(json.dumps(manifest))
    expected = "does not match its digest" if claim == "all zeros" else "is malformed"
    with pytest.raises(ValueError, match=rf"checkpoint\.bin.*{expected}"):
        read_manifest(copy)
