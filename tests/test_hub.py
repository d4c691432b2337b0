"""`hf-latentlm push` against a loopback Hub: a stdlib HTTP server that answers the calls huggingface_hub makes
(create repo, validate-yaml, preupload -> regular, NDJSON commit) and keeps every committed file."""

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from family_contract import build_tiny, multi_token_families
from huggingface_hub import ModelCard

REPO = "someone/tiny-plm"
COMMIT = "a" * 40
EXPECTED_PLM = {"auxiliaries.py", "config.json", "configuration_backbone.py", "configuration_plm.py", "generation.py",
                "generation_config.json", "layers.py", "model.safetensors", "modeling_backbone.py", "modeling_plm.py",
                "tokenizer.json", "tokenizer_config.json", "README.md"}


class FakeHub(BaseHTTPRequestHandler):
    files: dict = {}
    requests: list = []

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

    def body(self):
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def stored(self):
        """The stored file a `/<repo>/resolve/<rev>/<file>` path names, or None."""
        prefix = f"/{REPO}/resolve/"
        if not self.path.startswith(prefix):
            return None, None
        name = self.path[len(prefix):].split("?")[0].split("/", 1)[-1]
        return name, self.files.get(name)

    def send_file(self, data, with_body):
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if with_body:
            self.wfile.write(data)

    def do_HEAD(self):
        self.requests.append(("HEAD", self.path))
        name, data = self.stored()
        if data is None:
            self.reply(404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
        else:
            self.send_file(data, with_body=False)

    def do_GET(self):
        self.requests.append(("GET", self.path))
        name, data = self.stored()
        path = self.path.split("?")[0]
        if data is not None:
            self.send_file(data, with_body=True)
        elif path.startswith(f"/api/models/{REPO}/revision/") or path == f"/api/models/{REPO}":
            self.reply(200, {"id": REPO, "modelId": REPO, "sha": COMMIT, "private": False,
                             "siblings": [{"rfilename": n} for n in sorted(self.files)]})
        elif path.startswith(f"/api/models/{REPO}/tree/"):
            self.reply(200, [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                             for n, d in sorted(self.files.items())])
        else:
            self.reply(404, {"error": "not served"}, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})

    def do_POST(self):
        self.requests.append(("POST", self.path))
        raw = self.body()
        base = f"http://127.0.0.1:{self.server.server_port}"
        if self.path == "/api/repos/create":
            self.reply(200, {"url": f"{base}/{json.loads(raw)['organization']}/{json.loads(raw)['name']}"})
        elif self.path == "/api/validate-yaml":
            self.reply(200, {"errors": [], "warnings": []})
        elif "/preupload/" in self.path:
            files = json.loads(raw)["files"]
            self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                       for f in files]})
        elif "/commit/" in self.path:
            for line in raw.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] != "header":  # lfs / deletions: this fake Hub never asks for them
                    self.reply(400, {"error": f"unexpected {item['key']}"})
                    return
            oid = COMMIT
            self.reply(200, {"commitUrl": f"{base}/{REPO}/commit/{oid}", "commitOid": oid,
                             "pullRequestUrl": None, "success": True})
        else:
            self.reply(404, {"error": f"unknown {self.path}"})


@pytest.fixture
def fake_hub():
    FakeHub.files, FakeHub.requests = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", FakeHub
    server.shutdown()
    server.server_close()


def push(endpoint, tmp_path, *args):
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_dummy_token_for_tests", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hf_latentlm.cli", "push", *args], env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_push_uploads_the_model_and_a_card_and_nothing_else(tmp_path, fake_hub, tokenizer):
    endpoint, hub = fake_hub
    folder = tmp_path / "plm"
    build_tiny("plm", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # Training leftovers that must never leave the machine.
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "metrics.jsonl", "x.pkl"):
        (folder / name).write_bytes(b"secret")
    (folder / "checkpoint-2").mkdir()
    (folder / "checkpoint-2" / "model.safetensors").write_bytes(b"old")

    code, out, err = push(endpoint, tmp_path, "--model", str(folder), "--repo-id", REPO)
    assert code == 0, err
    assert f"{REPO}/commit/" in out and "hf_dummy" not in out + err
    assert set(hub.files) == EXPECTED_PLM
    assert hub.files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert json.loads(hub.files["config.json"])["auto_map"]["AutoModelForCausalLM"] == "modeling_plm.PLMForCausalLM"
    card = ModelCard(hub.files["README.md"].decode())
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.tags == ["plm", "custom_code", "hf-latentlm"] and card.data.license == "apache-2.0"
    assert "trust_remote_code=True" in card.text and "Parallel Language Model" in card.text
    assert ("POST", "/api/repos/create") in hub.requests

    # Load it back from the (fake) Hub with remote code only and compare generated tokens with the local folder.
    script = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
prompt = AutoTokenizer.from_pretrained({REPO!r}, trust_remote_code=True)("ROMEO.\\nTo be", return_tensors="pt").input_ids
out = []
for source in ({str(folder)!r}, {REPO!r}):
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
    out.append(model.generate(prompt, max_new_tokens=12, eos_token_id=None, **{{model.row_seeds_option: [3]}}))
    out.append(type(model).__module__)
print(out[0].tolist() == out[2].tolist(), out[0].shape[1] - prompt.shape[1], out[3])
"""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_dummy_token_for_tests", "HF_HUB_OFFLINE": "0",
           "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + str(hub.requests[-10:])
    same, length, module = proc.stdout.split()[-3:]
    assert same == "True" and length == "12" and module.startswith("transformers_modules.someone"), proc.stdout
    fetched = {path.rsplit("/", 1)[-1] for method, path in hub.requests if method == "GET" and "/resolve/" in path}
    assert {"model.safetensors", "config.json", "modeling_plm.py", "tokenizer.json"} <= fetched, fetched


@pytest.mark.parametrize("make,repo_id,needle", [
    (lambda d: (d / "config.json").write_text("{}"), REPO, "no model.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b""), REPO, "no config.json"),
    (lambda d: None, "not a valid/repo/id", "bad --repo-id"),
    (lambda d: None, "bad..name", "bad --repo-id"),
])
def test_push_refuses_with_one_line(tmp_path, run_cli, make, repo_id, needle):
    # Refused before any network call, so in this process (no Hub endpoint needed).
    folder = tmp_path / "m"
    folder.mkdir()
    make(folder)
    code, _, err = run_cli("push", "--model", str(folder), "--repo-id", repo_id)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("family", [f for f in multi_token_families() if f != "plm"])
def test_push_sends_every_familys_remote_code(tmp_path, fake_hub, tokenizer, family):
    endpoint, hub = fake_hub
    folder = tmp_path / family
    build_tiny(family, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "optimizer.pt").write_bytes(b"secret")
    code, _, err = push(endpoint, tmp_path, "--model", str(folder), "--repo-id", REPO)
    assert code == 0, err
    python_files = {p.name for p in folder.glob("*.py")}
    assert python_files and set(hub.files) == python_files | {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "README.md"}
    assert hub.files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert family in ModelCard(hub.files["README.md"].decode()).data.tags
