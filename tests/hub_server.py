"""A local HTTP server that speaks the part of the Hugging Face Hub API that huggingface_hub's downloads and
uploads use.

Reading: it serves folders as model repos, so the real client code (repo info, tree listing, HEAD for file
metadata, GET with Range for resumable downloads) is exercised against loopback. ``hold_after_bytes`` stops the
first weights download that many bytes in until ``release()``, so a test can kill a download half way whatever the
machine's load; ``delay_per_chunk`` slows file bodies down.

Writing (``create_repo``, ``create_commit`` over the classic LFS protocol, which the client uses when Xet is
disabled): repo creation, the preupload check (which files are LFS, and the oid of files already there), the LFS
batch endpoint (no upload action for an object already stored, as the Hub does), basic PUT uploads checked against
their sha256, and the NDJSON commit. ``token`` makes every write demand that bearer token; ``drop_uploads`` holds
sha256s whose uploads are cut off half way for as long as they are in it (a connection that keeps dropping).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

CHUNK = 64 * 1024
# A sample of the Hub's licence ids (huggingface.co/docs/hub/repositories-licenses) and base-model relations
HUB_LICENSES = {
    "apache-2.0",
    "mit",
    "other",
    "llama2",
    "llama3",
    "llama3.1",
    "llama3.2",
    "llama3.3",
    "llama4",
    "gemma",
    "cc-by-4.0",
    "cc-by-sa-4.0",
    "cc-by-nc-4.0",
    "bsd-3-clause",
    "openrail",
    "bigscience-openrail-m",
    "unknown",
}
BASE_MODEL_RELATIONS = {"adapter", "merge", "quantized", "finetune"}


class FakeHub:
    def __init__(
        self,
        repos: dict[str, Path],
        delay_per_chunk: float = 0.0,
        lfs_sha_override: dict | None = None,
        drop_after_bytes: int | None = None,
        token: str | None = None,
        hold_after_bytes: int | None = None,
    ):
        self.repos = {name: folder for name, folder in repos.items()}
        self.commits = {name: hashlib.sha1(name.encode()).hexdigest() for name in repos}
        self.delay_per_chunk = delay_per_chunk
        self.lfs_sha_override = lfs_sha_override or {}
        self.requests: list[str] = []
        self.ranges: list[str] = []  # Range headers of file requests: a resumed download sends one
        # Cut the connection once, this many bytes into the first weights download (a flaky network).
        self.drop_after_bytes = drop_after_bytes
        # Hold the first weights download this many bytes in until release() (or the server's shutdown).
        self.hold_after_bytes = hold_after_bytes
        self.released = threading.Event()
        self.token = token
        self.created: dict[str, dict] = {}  # repo -> {"private": bool}
        self.pushed: dict[str, dict[str, bytes]] = {}  # repo -> path -> content (after commits)
        self.lfs_objects: dict[str, bytes] = {}  # sha256 -> content, uploaded and verified
        self.lfs_puts: list[str] = []  # sha256 of every upload that completed
        self.commit_log: list[tuple[str, list[str]]] = []  # (repo, paths) of every commit
        self.drop_uploads: set[str] = set()
        self.auth_headers: list[str] = []  # every Authorization header seen on writes
        self.validated: list[dict] = []  # model card metadata checked by /api/validate-yaml
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def release(self) -> None:
        self.hold_after_bytes = None
        self.released.set()

    def __exit__(self, *exc) -> None:
        self.release()
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

            # ------------------------------------------------------------------------------- writes

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    data = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _authorized(self) -> bool:
                header = self.headers.get("Authorization", "")
                hub.auth_headers.append(header)
                if hub.token is None or header == f"Bearer {hub.token}":
                    return True
                body = b'{"error": "Invalid credentials in Authorization header"}'
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return False

            def do_POST(self):
                path = self.path.split("?", 1)[0]
                hub.requests.append(f"POST {path}")
                if path == "/api/repos/create":
                    return self._create_repo()
                if path == "/api/validate-yaml":
                    return self._validate_yaml()
                if m := re.match(r"^/api/models/([^/]+/[^/]+)/preupload/([^/]+)$", path):
                    return self._preupload(m.group(1))
                if m := re.match(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/batch$", path):
                    return self._lfs_batch(m.group(1))
                if m := re.match(r"^/api/models/([^/]+/[^/]+)/commit/([^/]+)$", path):
                    return self._commit(m.group(1))
                self._body()
                self._not_found()

            def do_PUT(self):
                path = self.path.split("?", 1)[0]
                hub.requests.append(f"PUT {path}")
                m = re.match(r"^/lfs-upload/([^/]+/[^/]+)/([0-9a-f]{64})$", path)
                if not m:
                    return self._not_found()
                oid = m.group(2)
                if oid in hub.drop_uploads:
                    length = int(self.headers.get("Content-Length", 0))
                    self.rfile.read(length // 2)
                    self.close_connection = True
                    self.connection.shutdown(2)  # cut off mid-body, no response
                    return
                data = self._body()
                if hashlib.sha256(data).hexdigest() != oid:
                    return self._json({"error": "sha256 mismatch"}, status=400)
                hub.lfs_objects[oid] = data
                hub.lfs_puts.append(oid)
                self._json({})

            def _create_repo(self):
                payload = json.loads(self._body() or b"{}")
                if not self._authorized():
                    return
                repo = f"{payload.get('organization')}/{payload['name']}"
                if repo in hub.created or repo in hub.repos:
                    return self._json(
                        {"error": "You already created this model repo", "url": f"{hub.endpoint}/{repo}"}, 409
                    )
                hub.created[repo] = {"private": payload.get("visibility") == "private" or bool(payload.get("private"))}
                hub.pushed[repo] = {}
                self._json({"url": f"{hub.endpoint}/{repo}", "name": repo})

            def _validate_yaml(self):
                """The model card metadata checks the Hub makes on a commit that holds README.md (a subset)."""
                content = json.loads(self._body())["content"]
                errors = []
                try:
                    front = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else {}
                except yaml.YAMLError as exc:
                    front, errors = {}, [f"YAML does not parse: {exc}"]
                if not isinstance(front, dict):
                    front, errors = {}, ["metadata must be a mapping"]
                hub.validated.append(front)
                if "license" in front and front["license"] not in HUB_LICENSES:
                    errors.append(f'"license" must be one of the Hub licence ids, not {front["license"]!r}')
                if front.get("license") == "other" and not front.get("license_name"):
                    errors.append('"license_name" is required when "license" is "other"')
                if "pipeline_tag" in front and front["pipeline_tag"] not in ("text-generation", "text2text-generation"):
                    errors.append(f'unknown "pipeline_tag" {front["pipeline_tag"]!r}')
                if "base_model_relation" in front and front["base_model_relation"] not in BASE_MODEL_RELATIONS:
                    errors.append(f'unknown "base_model_relation" {front["base_model_relation"]!r}')
                base = front.get("base_model")
                if base is not None and not all(
                    isinstance(b, str) and "/" in b for b in (base if isinstance(base, list) else [base])
                ):
                    errors.append('"base_model" must be Hub model ids')
                if not all(isinstance(tag, str) for tag in front.get("tags") or []):
                    errors.append('"tags" must be strings')
                if errors:
                    return self._json({"errors": [{"message": e} for e in errors]}, 400)
                self._json({"errors": [], "warnings": []})

            def _preupload(self, repo: str):
                payload = json.loads(self._body())
                if not self._authorized():
                    return
                if repo not in hub.created:
                    return self._not_found()
                files = []
                for item in payload["files"]:
                    lfs = item["path"].endswith((".gguf", ".safetensors", ".bin")) or item["size"] > 10 * 1024 * 1024
                    existing = hub.pushed[repo].get(item["path"])
                    oid = None
                    if existing is not None:
                        oid = hashlib.sha256(existing).hexdigest() if lfs else _git_sha1(existing)
                    files.append(
                        {
                            "path": item["path"],
                            "uploadMode": "lfs" if lfs else "regular",
                            "shouldIgnore": False,
                            "oid": oid,
                        }
                    )
                self._json({"files": files, "commitOid": hub.commits.get(repo)})

            def _lfs_batch(self, repo: str):
                payload = json.loads(self._body())
                if not self._authorized():
                    return
                objects = []
                for item in payload["objects"]:
                    entry = {"oid": item["oid"], "size": item["size"]}
                    if item["oid"] not in hub.lfs_objects:
                        entry["actions"] = {"upload": {"href": f"{hub.endpoint}/lfs-upload/{repo}/{item['oid']}"}}
                    objects.append(entry)
                self._json({"transfer": "basic", "objects": objects})

            def _commit(self, repo: str):
                lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
                if not self._authorized():
                    return
                if repo not in hub.created:
                    return self._not_found()
                changes = {}
                for line in lines:
                    if line["key"] == "file":
                        changes[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                    elif line["key"] == "lfsFile":
                        oid = line["value"]["oid"]
                        if oid not in hub.lfs_objects:
                            return self._json({"error": f"LFS object {oid} was never uploaded"}, 422)
                        changes[line["value"]["path"]] = hub.lfs_objects[oid]
                hub.pushed[repo].update(changes)
                commit = hashlib.sha1(repr((repo, len(hub.commit_log), sorted(changes))).encode()).hexdigest()
                hub.commits[repo] = commit
                hub.commit_log.append((repo, sorted(changes)))
                self._json({"commitUrl": f"{hub.endpoint}/{repo}/commit/{commit}", "commitOid": commit})

            # ------------------------------------------------------------------------------- reads

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
                hold = hub.hold_after_bytes if file.suffix == ".safetensors" and not ranged else None
                for offset in range(start, len(data), CHUNK):
                    if hold is not None and offset - start >= hold:
                        self.wfile.flush()
                        hub.released.wait(timeout=600)
                        hold = None
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


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob " + str(len(data)).encode() + b"\0" + data).hexdigest()


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


if __name__ == "__main__":  # a standalone server for kill-during-download tests: python hub_server.py REPO DIR DELAY
    import sys

    hub = FakeHub({sys.argv[1]: Path(sys.argv[2])}, delay_per_chunk=float(sys.argv[3]))
    print(hub.endpoint, flush=True)
    hub.serve_forever()
