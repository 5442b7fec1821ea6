"""Serve the example page on localhost, the artifacts under ``/artifacts/`` (stdlib only).

    python examples/js/serve.py ARTIFACTS [--port 8000]

then open ``http://127.0.0.1:8000/``. JavaScript modules and WebAssembly get their MIME
types, and the page is cross-origin isolated (COOP/COEP headers), as onnxruntime-web wants.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import posixpath
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREFIX = "/artifacts/"


class Handler(http.server.SimpleHTTPRequestHandler):
    """Files of the example folder; ``/artifacts/...`` from the artifact folder."""

    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".mjs": "text/javascript",
        ".js": "text/javascript",
        ".wasm": "application/wasm",
        ".json": "application/json",
        ".onnx": "application/octet-stream",
        ".bin": "application/octet-stream",
    }

    def __init__(self, *args, artifacts: Path, **kwargs):
        self.artifacts = artifacts
        super().__init__(*args, **kwargs)

    def translate_path(self, path: str) -> str:
        clean = posixpath.normpath(urllib.parse.unquote(path.split("?", 1)[0].split("#", 1)[0]))
        if clean.startswith(PREFIX):
            parts = [p for p in clean[len(PREFIX) :].split("/") if p not in ("", ".", "..")]
            return os.path.join(self.artifacts, *parts)
        return super().translate_path(path)

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args) -> None:
        pass


def make_server(artifacts: str | os.PathLike, port: int = 0) -> http.server.ThreadingHTTPServer:
    """A server on 127.0.0.1 (``port`` 0: a free one) for the example and ``artifacts``."""
    handler = functools.partial(Handler, directory=str(HERE), artifacts=Path(artifacts))
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifacts", help="the folder written by 'onnxgrad artifacts'")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    server = make_server(args.artifacts, args.port)
    print(f"serving http://127.0.0.1:{server.server_port}/ (Ctrl-C stops)")
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
