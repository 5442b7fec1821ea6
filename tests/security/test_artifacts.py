"""Artifact folders from elsewhere, and folders half-written: replaced as a unit, refused
by name when mixed, changed or inconsistent, every field of artifacts.json checked.

References: the files generate_artifacts wrote (bytes), numpy for merged weights; the
cases that would allocate from a declared size run in a capped child.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from onnxgrad.training import (
    Checkpoint,
    generate_artifacts,
    load_checkpoint,
    load_train_step,
    merge_checkpoint,
)
from onnxgrad.training.artifacts import generate as artifacts_module
from tests.models import linear_regression_model
from tests.security.isolated import refused, run_cases

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX links")


def _model(coefs=(1.0, 2.0)):
    return linear_regression_model(np.array(coefs), np.array([0.5]))


@pytest.fixture
def art(tmp_path) -> Path:
    generate_artifacts(_model(), optimizer="adam", folder=tmp_path / "art")
    return tmp_path / "art"


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "artifacts.json").read_text())


def _rewrite(folder: Path, manifest: dict, redigest: bool = True) -> None:
    """Write ``manifest`` with digests recomputed, as a deliberate forger would."""
    if redigest:
        for name in manifest["files"]:
            data = (folder / name).read_bytes()
            manifest["files"][name] = {
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
            }
    (folder / "artifacts.json").write_text(json.dumps(manifest))


def test_a_mixed_folder_is_refused_naming_the_file(art, tmp_path):
    generate_artifacts(_model((3.0, 4.0, 5.0)), optimizer="sgd", folder=tmp_path / "other")
    (art / "training_model.onnx").write_bytes((tmp_path / "other/training_model.onnx").read_bytes())
    with pytest.raises(ValueError, match=r"training_model\.onnx.*does not match its digest"):
        load_train_step(art)
    with pytest.raises(ValueError, match="does not match its digest"):
        merge_checkpoint(art, load_checkpoint(art / "checkpoint.json"))


def test_a_changed_checkpoint_is_refused(art):
    data = bytearray((art / "checkpoint.bin").read_bytes())
    data[0] ^= 1
    (art / "checkpoint.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"checkpoint\.bin.*does not match its digest"):
        load_train_step(art)


def test_a_checkpoint_of_other_artifacts_is_not_merged(art, tmp_path):
    other = generate_artifacts(_model((3.0, 4.0, 5.0)), folder=tmp_path / "other")
    with pytest.raises(ValueError, match="coefs"):
        merge_checkpoint(art, other.checkpoint)
    wrong_shape = Checkpoint({"coefs": np.ones((3, 1), np.float32), "intercept": np.ones(1)})
    with pytest.raises(ValueError, match=r"checkpoint weight 'coefs' is float32 \[3, 1\]"):
        merge_checkpoint(art / "inference_model.onnx", wrong_shape)


@pytest.mark.parametrize(
    ("entry", "value", "fragment"),
    [
        ("training_model", "../training_model.onnx", "not a plain file name"),
        ("training_model", "/etc/passwd", "not a plain file name"),
        ("checkpoint", ["checkpoint.json"], "must be a file name"),
        ("version", 1, "write the folder again"),
        ("files", [], "'files' must map"),
    ],
)
def test_manifest_entries_are_checked(art, entry, value, fragment):
    manifest = _manifest(art)
    manifest[entry] = value
    _rewrite(art, manifest, redigest=False)
    with pytest.raises(ValueError, match=fragment):
        load_train_step(art)


def test_a_listed_file_linked_out_of_the_folder_is_refused(art, tmp_path):
    outside = tmp_path / "outside.onnx"
    outside.write_bytes((art / "training_model.onnx").read_bytes())
    (art / "training_model.onnx").unlink()
    (art / "training_model.onnx").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the folder"):
        load_train_step(art)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda t: t.update(features="X"), "features must be a non-empty list"),
        (lambda t: t.update(label=["label"]), "label must be a name"),
        (lambda t: t["weights"][0].update(shape=[-2, 1]), "shape must be a list of integers"),
        (lambda t: t["weights"][0].update(shape=[True, 1]), "shape must be a list of integers"),
        (lambda t: t["state"][0].update(shared="yes"), "shared is invalid"),
        (lambda t: t["weights"][0].update(input="intercept"), "more than once"),
        (lambda t: t["weights"][0].update(shape=[2, 2]), "its checkpoint holds"),
    ],
)
def test_train_fields_are_type_checked(art, change, fragment):
    manifest = _manifest(art)
    change(manifest["train"])
    _rewrite(art, manifest)
    with pytest.raises(ValueError, match=fragment):
        load_train_step(art)


def test_regenerating_replaces_the_folder_as_a_whole(tmp_path):
    folder = tmp_path / "art"
    X = np.ones((4, 2), np.float32)
    generate_artifacts(_model(), folder=folder, data=(X, X[:, 0]))
    assert (folder / "data.json").exists()
    generate_artifacts(_model((3.0, 4.0, 5.0)), optimizer="sgd", folder=folder)
    written = {p.name for p in folder.iterdir()}
    assert written == {*_manifest(folder)["files"], "artifacts.json"}
    assert not (folder / "data.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert load_train_step(folder).weight_shapes["coefs"] == (3, 1)


def test_an_interrupted_regeneration_leaves_the_old_folder(tmp_path, monkeypatch):
    folder = tmp_path / "art"
    generate_artifacts(_model(), folder=folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts_module, "save_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate_artifacts(_model((3.0, 4.0, 5.0)), folder=folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_leftovers_of_a_killed_run_are_removed(tmp_path):
    stale = tmp_path / ".art.0123456789ab.tmp"
    stale.mkdir()
    (stale / "training_model.onnx").write_bytes(b"half")
    generate_artifacts(_model(), folder=tmp_path / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_folder_with_other_files_is_not_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files onnxgrad did not write \('notes.txt'\)"):
        generate_artifacts(_model(), folder=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_command_creates_the_folder_and_its_parents(tmp_path):
    from tests.cli.helpers import run_in_process, save

    save(_model(), tmp_path / "lr.onnx")
    result = run_in_process("artifacts", "lr.onnx", "-o", "a/b/art", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    load_train_step(tmp_path / "a/b/art")


def _forged_state_shape(folder: Path) -> None:
    generate_artifacts(_model(), optimizer="adam", folder=folder)
    manifest = _manifest(folder)
    manifest["train"]["state"][1]["shape"] = [2**40, 2**20]
    _rewrite(folder, manifest)


def _forged_lora(folder: Path) -> None:
    """Adapters A [n, 1] and B [1, n] declared for a [2, 1] weight: A @ B is n^2 float64."""
    from onnx import helper

    from tests.cli.helpers import save

    n = 2**14
    model = _model()
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.ones((n, 1), np.float32), "A"),
            numpy_helper.from_array(np.ones((1, n), np.float32), "B"),
        ]
    )
    adapter = {"weight": "coefs", "a": "A", "b": "B", "scale": 1.0, "output": "x", "nodes": []}
    helper.set_model_props(model, {"onnxgrad.lora": json.dumps([adapter])})
    save(model, folder / "m.onnx")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    _forged_state_shape(state / "art")
    lora = tmp_path_factory.mktemp("lora")
    _forged_lora(lora)
    return run_cases(
        {
            "state-shape": (
                state,
                "from onnxgrad.training import load_train_step\nload_train_step('art')\n",
            ),
            "lora": (lora, "from onnxgrad.graph.lora import merge_lora\nmerge_lora('m.onnx')\n"),
        }
    )


def test_a_forged_state_shape_is_refused_before_allocating(reports):
    refused(reports["state-shape"], "ValueError", "state 'coefs_m' has shape")


def test_lora_shapes_are_checked_against_the_weight_before_merging(reports):
    refused(reports["lora"], "ValueError", "does not give a [2, 1] update")


def test_temporaries_of_killed_writes_are_removed_and_live_ones_kept(tmp_path):
    from onnxgrad._leftovers import held
    from onnxgrad.training import save_checkpoint

    killed = tmp_path / ".c.json.0123456789ab.tmp"
    killed.write_text("half")
    live = tmp_path / ".c.json.ba9876543210.tmp"
    live.write_text("being written")
    with held(live):
        save_checkpoint(Checkpoint({"w": np.ones(2, np.float32)}), tmp_path / "c.json")
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "c.bin", "c.json"]
