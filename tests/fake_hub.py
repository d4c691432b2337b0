"""A loopback Hugging Face Hub for the push tests: a stdlib HTTP server that answers the calls huggingface_hub makes
(create repo, create branch, validate-yaml, preupload -> regular, NDJSON commit) and serves what it stored per branch
(resolve, model info, tree). `fake_hub` (a fixture) yields (endpoint URL, the handler class holding the repos)."""

import base64
import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest


class FakeHub(BaseHTTPRequestHandler):
    """Repositories as {repo_id: {branch: {path: bytes}}}; one commit id per branch state."""

    repos: dict = {}
    requests: list = []
    visibility: dict = {}  # repo id -> the visibility it was created with

    def log_message(self, *args):
        pass

    def reply(self, code, body=None, headers=None):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    @classmethod
    def commit_of(cls, repo, branch):
        files = cls.repos[repo][branch]
        state = "".join(f"{n}:{hashlib.sha1(d).hexdigest()}" for n, d in sorted(files.items()))
        return hashlib.sha1(f"{repo}@{branch}:{state}".encode()).hexdigest()

    def not_found(self, code="EntryNotFound"):
        self.reply(404, {"error": code}, {"X-Error-Code": code})

    def files_of(self, repo, revision):
        """The files of a branch, or of a branch's current commit id (huggingface_hub resolves a branch to its commit
        first), or None after answering 404 as the Hub does."""
        if repo not in self.repos:
            self.not_found("RepoNotFound")
            return None
        branches = self.repos[repo]
        branch = revision if revision in branches else next(
            (b for b in branches if self.commit_of(repo, b) == revision), None)
        if branch is None:
            self.not_found("RevisionNotFound")
            return None
        return branches[branch]

    def route(self, method):
        self.requests.append((method, self.path))
        path = self.path.split("?")[0]
        if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, revision, name = match[1], unquote(match[2]), unquote(match[3])
            files = self.files_of(repo, revision)
            if files is None:
                return
            commit = next(self.commit_of(repo, b) for b, f in self.repos[repo].items() if f is files)
            if name not in files:
                self.reply(404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
                return
            data = files[name]
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", commit)
            self.end_headers()
            if method == "GET":
                self.wfile.write(data)
            return
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?", path):
            repo, kind, revision = match[1], match[2], unquote(match[3] or "main")
            files = self.files_of(repo, revision)
            if files is None:
                return
            commit = next(self.commit_of(repo, b) for b, f in self.repos[repo].items() if f is files)
            if kind == "tree":
                self.reply(200, [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                 for n, d in sorted(files.items())])
            else:
                self.reply(200, {"id": repo, "modelId": repo, "sha": commit, "private": False,
                                 "siblings": [{"rfilename": n} for n in sorted(files)]})
            return
        self.not_found()

    def do_HEAD(self):
        self.route("HEAD")

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.requests.append(("POST", self.path))
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        base = f"http://127.0.0.1:{self.server.server_port}"
        path = self.path.split("?")[0]
        if path == "/api/repos/create":
            body = json.loads(raw)
            repo = f"{body['organization']}/{body['name']}"
            self.repos.setdefault(repo, {"main": {}})
            self.visibility[repo] = body.get("visibility")
            self.reply(200, {"url": f"{base}/{repo}"})
        elif path == "/api/validate-yaml":
            self.reply(200, {"errors": [], "warnings": []})
        elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/([^/]+)", path):
            repo, branch = match[1], unquote(match[2])
            if self.files_of(repo, "main") is None:
                return
            if branch in self.repos[repo]:
                self.reply(409, {"error": "Reference already exists"})
                return
            self.repos[repo][branch] = dict(self.repos[repo]["main"])  # a new branch starts from main
            self.reply(200, {})
        elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path):
            repo, kind, branch = match[1], match[2], unquote(match[3])
            files = self.files_of(repo, branch)
            if files is None:
                return
            if kind == "preupload":
                self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                           for f in json.loads(raw)["files"]]})
                return
            for line in raw.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] != "header":  # lfs / deletions: this fake Hub never asks for them
                    self.reply(400, {"error": f"unexpected {item['key']}"})
                    return
            oid = self.commit_of(repo, branch)
            self.reply(200, {"commitUrl": f"{base}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None,
                             "success": True})
        else:
            self.not_found()


@pytest.fixture(scope="module")
def fake_hub():
    FakeHub.repos, FakeHub.requests, FakeHub.visibility = {}, [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", FakeHub
    server.shutdown()
    server.server_close()


def hub_env(endpoint, home) -> dict:
    return {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_dummy_token_for_tests", "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
