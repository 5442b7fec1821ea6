"""Serve the example page on localhost, the artifacts under ``/artifacts/`` (stdlib only).

    python examples/js/serve.py ARTIFACTS [--port 8000]

then open ``http://127.0.0.1:8000/``. JavaScript modules and WebAssembly get their MIME
types, and the page is cross-origin isolated (COOP/COEP headers), as onnxruntime-web wants.

Only files are served, from the example's folder or the artifact folder: no folder listing,
no path whose real location (links followed) leaves its folder, and only requests whose
``Host`` is this machine's loopback name (a page elsewhere cannot reach the server through
a DNS name pointed at 127.0.0.1).
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
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")


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
        return str(self._locate(path)[1])

    def _locate(self, path: str) -> tuple[Path, Path]:
        """``(root, file)``: the folder a request path is served from, and its file there
        (``index.html`` for the root)."""
        clean = posixpath.normpath(urllib.parse.unquote(path.split("?", 1)[0].split("#", 1)[0]))
        root, rest = (
            (self.artifacts, clean[len(PREFIX) :]) if clean.startswith(PREFIX) else (HERE, clean)
        )
        parts = [p for p in rest.split("/") if p not in ("", ".", "..")]
        return root, root.joinpath(*parts) if parts else root / "index.html"

    def send_head(self):
        if not _local_host(self.headers.get("Host", "")):
            self.send_error(403, "Host must be 127.0.0.1 or localhost")
            return None
        if not _serves(*self._locate(self.path)):
            self.send_error(404, "File not found")
            return None
        return super().send_head()

    def list_directory(self, path):
        self.send_error(404, "File not found")
        return None

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args) -> None:
        pass


def _local_host(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name.lower() in LOCAL_HOSTS


def _serves(root: Path, path: Path) -> bool:
    """Whether ``path`` is a regular file whose real path lies in ``root``."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real.startswith(base.rstrip(os.sep) + os.sep) and os.path.isfile(real)


def make_server(artifacts: str | os.PathLike, port: int = 0) -> http.server.ThreadingHTTPServer:
    """A server on 127.0.0.1 (``port`` 0: a free one) for the example and ``artifacts``."""
    handler = functools.partial(Handler, directory=str(HERE), artifacts=Path(artifacts).resolve())
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
