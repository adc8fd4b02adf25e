"""A local HTTP server that speaks the part of the Hugging Face Hub API that ``snapshot_download`` uses.

It serves folders as model repos, so the real huggingface_hub client code (repo info, tree listing, HEAD for file
metadata, GET with Range for resumable downloads) is exercised against loopback. ``delay_per_chunk`` slows file
bodies down so a test can kill a download half way.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 64 * 1024


class FakeHub:
    def __init__(
        self,
        repos: dict[str, Path],
        delay_per_chunk: float = 0.0,
        lfs_sha_override: dict | None = None,
        drop_after_bytes: int | None = None,
    ):
        self.repos = {name: folder for name, folder in repos.items()}
        self.commits = {name: hashlib.sha1(name.encode()).hexdigest() for name in repos}
        self.delay_per_chunk = delay_per_chunk
        self.lfs_sha_override = lfs_sha_override or {}
        self.requests: list[str] = []
        self.ranges: list[str] = []  # Range headers of file requests: a resumed download sends one
        # Cut the connection once, this many bytes into the first weights download (a flaky network).
        self.drop_after_bytes = drop_after_bytes
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def _files(self, repo: str) -> list[Path]:
        folder = self.repos[repo]
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _json(self, value, status=200):
                body = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _not_found(self):
                body = b'{"error": "Repository not found"}'
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _route(self):
                path = self.path.split("?", 1)[0]
                hub.requests.append(f"{self.command} {path}")
                if m := re.match(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$", path):
                    return "info", m.group(1), None
                if m := re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?$", path):
                    return "tree", m.group(1), None
                if m := re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path):
                    return "file", m.group(1), m.group(3)
                return None, None, None

            def do_GET(self):
                self._serve(send_body=True)

            def do_HEAD(self):
                self._serve(send_body=False)

            def _serve(self, send_body):
                kind, repo, name = self._route()
                if repo not in hub.repos:
                    return self._not_found()
                commit = hub.commits[repo]
                folder = hub.repos[repo]
                if kind == "info":
                    siblings = [{"rfilename": p.relative_to(folder).as_posix()} for p in hub._files(repo)]
                    return self._json(
                        {
                            "id": repo,
                            "modelId": repo,
                            "sha": commit,
                            "siblings": siblings,
                            "private": False,
                            "gated": False,
                            "disabled": False,
                        }
                    )
                if kind == "tree":
                    entries = []
                    for file in hub._files(repo):
                        rel = file.relative_to(folder).as_posix()
                        entry = {
                            "type": "file",
                            "path": rel,
                            "size": file.stat().st_size,
                            "oid": hashlib.sha1(file.read_bytes()).hexdigest(),
                        }
                        if file.suffix == ".safetensors":
                            entry["lfs"] = {
                                "oid": hub.lfs_sha_override.get(rel, _sha256(file)),
                                "size": file.stat().st_size,
                                "pointerSize": 134,
                            }
                        entries.append(entry)
                    return self._json(entries)
                if kind == "file":
                    file = folder / name
                    if not file.is_file():
                        self.send_response(404)
                        self.send_header("X-Error-Code", "EntryNotFound")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    return self._file(file, commit, send_body)
                self._not_found()

            def _file(self, file: Path, commit: str, send_body: bool):
                data = file.read_bytes()
                etag = _sha256(file) if file.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
                start = 0
                if self.command == "GET" and self.headers.get("Range"):
                    hub.ranges.append(self.headers["Range"])
                ranged = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if ranged:
                    start = int(ranged.group(1))
                self.send_response(206 if ranged else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{etag}"')
                if file.suffix == ".safetensors":
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Content-Length", str(len(data) - start))
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not send_body:
                    return
                drop = hub.drop_after_bytes if file.suffix == ".safetensors" and not ranged else None
                for offset in range(start, len(data), CHUNK):
                    if drop is not None and offset - start >= drop:
                        hub.drop_after_bytes = None
                        self.close_connection = True
                        return
                    try:
                        self.wfile.write(data[offset : offset + CHUNK])
                    except (BrokenPipeError, ConnectionResetError):
                        return
                    if hub.delay_per_chunk:
                        time.sleep(hub.delay_per_chunk)

        return Handler


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


if __name__ == "__main__":  # a standalone server for kill-during-download tests: python hub_server.py REPO DIR DELAY
    import sys

    hub = FakeHub({sys.argv[1]: Path(sys.argv[2])}, delay_per_chunk=float(sys.argv[3]))
    print(hub.endpoint, flush=True)
    hub.serve_forever()
