"""examples/js/serve.py serves files of its folder and of the artifact folder only: no
folder listing, no link out of either folder, and only to requests for a loopback Host.

The reference is the bytes of the files on disk."""

from __future__ import annotations

import http.client
import importlib.util
import os
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "js"

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX links")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("example_js_serve", EXAMPLE / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path_factory.mktemp("artifacts")
    (folder / "artifacts.json").write_text('{"format": "onnxgrad.artifacts"}')
    (folder / "sub").mkdir()
    (folder / "sub" / "inner.bin").write_bytes(b"inner")
    secret = tmp_path_factory.mktemp("elsewhere") / "secret.txt"
    secret.write_text("secret")
    (folder / "link.txt").symlink_to(secret)
    (folder / "dir-link").symlink_to(secret.parent, target_is_directory=True)
    (folder / "inside-link.json").symlink_to(folder / "artifacts.json")
    httpd = module.make_server(folder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_port, folder
    httpd.shutdown()
    httpd.server_close()


def _get(port: int, path: str, host: str | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("GET", path, skip_host=True)
        connection.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("path", "file"),
    [
        ("/artifacts/artifacts.json", "artifacts.json"),
        ("/artifacts/sub/inner.bin", "sub/inner.bin"),
        ("/artifacts/inside-link.json", "artifacts.json"),
    ],
)
def test_files_of_the_artifact_folder_are_served(server, path, file):
    port, folder = server
    assert _get(port, path) == (200, (folder / file).read_bytes())


def test_the_page_is_served(server):
    port, _ = server
    status, body = _get(port, "/")
    assert (status, body) == (200, (EXAMPLE / "index.html").read_bytes())


@pytest.mark.parametrize(
    "path",
    [
        "/artifacts/",
        "/artifacts/sub/",
        "/artifacts/link.txt",
        "/artifacts/dir-link/secret.txt",
        "/artifacts/../../../etc/passwd",
        "/artifacts/%2e%2e/%2e%2e/etc/passwd",
        "/..%2f..%2fetc/passwd",
        "/artifacts/missing.json",
    ],
)
def test_listings_links_out_and_escapes_are_not_found(server, path):
    port, _ = server
    status, body = _get(port, path)
    assert status == 404
    assert b"secret" not in body and b"root:" not in body


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.evil.example:80", ""])
def test_only_loopback_hosts_are_answered(server, host):
    port, _ = server
    assert _get(port, "/artifacts/artifacts.json", host=host)[0] == 403


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "[::1]:{port}"])
def test_loopback_names_are_answered(server, host):
    port, _ = server
    assert _get(port, "/artifacts/artifacts.json", host=host.format(port=port))[0] == 200
