"""A bounded load check of `hf-latentlm serve`: N requests from C concurrent clients against one model, then a sample
of them again one at a time, to check that batching changed no row's text.

Starts the server itself (or uses --url), sends a fixed workload (prompts from the embedded validation corpus, a
seed per request, max_tokens cycling up to --max-tokens, every --stream-every-th request streamed), stops by itself
(the requests are bounded, each has a timeout, and no request starts after --max-seconds), and prints one Markdown
row and a JSON record: requests/s, completion tokens/s, p50 / p95 latency of the answered requests, the count of each
status (2xx, 429, 503, other, including transport errors), the batch sizes the server ran (its /metrics), and how
many of the re-run requests differ from their answer under load.

    OMP_NUM_THREADS=1 python scripts/load_check_server.py --model runs/real-small/ar-x1 --requests 200 --concurrency 8
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder to serve (the script starts the server)")
    parser.add_argument("--url", help="an already running server instead, e.g. http://127.0.0.1:8000")
    parser.add_argument("--name", help="the model's name on the server (default: the folder's name / the only one)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens cycles through 1/4, 1/2 and all of it")
    parser.add_argument("--stream-every", type=int, default=4, help="every Nth request streams (0: none)")
    parser.add_argument("--recheck", type=int, default=16, help="requests re-sent alone to compare their text")
    parser.add_argument("--max-batch-size", type=int, default=8, help="the started server's --max-batch-size")
    parser.add_argument("--max-queue", type=int, default=64, help="the started server's --max-queue")
    parser.add_argument("--max-seconds", type=float, default=170.0, help="no request starts after this")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--json", help="also write the record here")
    args = parser.parse_args(argv)
    if (args.model is None) == (args.url is None):
        parser.error("give --model DIR (start a server) or --url URL (use a running one)")
    if min(args.requests, args.concurrency, args.max_tokens) < 1 or args.recheck < 0:
        parser.error("--requests, --concurrency and --max-tokens must be at least 1, --recheck >= 0")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "hf_latentlm.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-batch-size", str(args.max_batch_size), "--max-queue", str(args.max_queue),
               "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        if process.poll() is not None:
            sys.exit(f"the server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            sys.exit("the server did not come up in 300 s")
        time.sleep(0.2)


def workload(args) -> list[dict]:
    """The fixed requests: the validation corpus's first lines as prompts, a seed each."""
    from hf_latentlm.training.corpus import load_corpus_documents

    lines = [line.strip() for doc in load_corpus_documents("validation")[:20] for line in doc.splitlines()]
    prompts = [line for line in lines if len(line) > 20][:50]
    sizes = sorted({max(1, args.max_tokens // 4), max(1, args.max_tokens // 2), args.max_tokens})
    return [{"prompt": prompts[i % len(prompts)], "seed": 1000 + i, "max_tokens": sizes[i % len(sizes)],
             "stream": bool(args.stream_every) and i % args.stream_every == 0} for i in range(args.requests)]


def send(client: httpx.Client, name: str, body: dict, timeout: float) -> dict:
    """One request -> {"status", "latency", "text", "batch_size", "tokens"} (status "error" for a transport error)."""
    start = time.perf_counter()
    payload = {"model": name, **body}
    try:
        if body["stream"]:
            text, last, status = [], None, None
            with client.stream("POST", "/v1/completions", json=payload, timeout=timeout) as response:
                status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return {"status": "stream-error", "latency": time.perf_counter() - start}
                        text.append(chunk["choices"][0]["text"])
                        last = chunk
            if status != 200:
                return {"status": status, "latency": time.perf_counter() - start}
            return {"status": 200, "latency": time.perf_counter() - start, "text": "".join(text),
                    "batch_size": last["hf_latentlm"]["batch_size"], "tokens": None}
        response = client.post("/v1/completions", json=payload, timeout=timeout)
        result = {"status": response.status_code, "latency": time.perf_counter() - start}
        if response.status_code == 200:
            answer = response.json()
            result.update(text=answer["choices"][0]["text"], batch_size=answer["hf_latentlm"]["batch_size"],
                          tokens=answer["usage"]["completion_tokens"])
        return result
    except httpx.HTTPError as err:
        return {"status": "error", "latency": time.perf_counter() - start, "error": repr(err)}


def run_load(url: str, name: str, requests: list[dict], args) -> tuple[list[dict | None], float]:
    local = threading.local()
    deadline = time.monotonic() + args.max_seconds

    def one(body):
        if time.monotonic() > deadline:
            return None  # not sent: the time bound
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url)
        return send(local.client, name, body, args.request_timeout)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, requests))
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    process = None
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"load_check_server_{os.getpid()}.log"
    try:
        if args.model:
            process, url = start_server(args, log)
        else:
            url = args.url.rstrip("/")
        models = httpx.get(f"{url}/v1/models").json()["data"]
        name = args.name or (Path(args.model).resolve().name if args.model else models[0]["id"])
        before = httpx.get(f"{url}/metrics").json()[name]
        requests = workload(args)
        results, seconds = run_load(url, name, requests, args)
        after = httpx.get(f"{url}/metrics").json()[name]
        answered = [(body, r) for body, r in zip(requests, results) if r is not None and r["status"] == 200]
        # Re-send a spread-out sample alone (the server is idle now: each runs in a batch of its own).
        sample = answered[:: max(1, len(answered) // args.recheck)][: args.recheck] if args.recheck else []
        with httpx.Client(base_url=url) as client:
            rechecked = [(r, send(client, name, body, args.request_timeout)) for body, r in sample]
        differing = [r for r, again in rechecked if again.get("text") != r["text"]]
        not_alone = [again for _, again in rechecked if again.get("batch_size") != 1]
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    statuses = [r["status"] if r is not None else "not sent" for r in results]
    latencies = [r["latency"] for _, r in answered]
    sizes = {int(k): v - before["batch_sizes"].get(k, 0) for k, v in after["batch_sizes"].items()}
    tokens = after["generated_tokens"] - before["generated_tokens"]
    record = {
        "model": args.model or url, "name": name, "model_type": next(m for m in models if m["id"] == name)["model_type"],
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "seconds": round(seconds, 2), "requests_per_s": round(len(answered) / seconds, 3),
        "generated_tokens_per_s": round(tokens / seconds, 1),
        "p50_latency_s": round(percentile(latencies, 50), 3) if latencies else None,
        "p95_latency_s": round(percentile(latencies, 95), 3) if latencies else None,
        "status_2xx": sum(isinstance(s, int) and 200 <= s < 300 for s in statuses),
        "status_429": statuses.count(429), "status_503": statuses.count(503),
        "status_other": sum(not (isinstance(s, int) and (200 <= s < 300 or s in (429, 503))) and s != "not sent"
                            for s in statuses),
        "not_sent": statuses.count("not sent"),
        "batch_sizes": {k: v for k, v in sorted(sizes.items()) if v},
        "rechecked_alone": len(rechecked), "rechecked_not_alone": len(not_alone), "differing_from_alone": len(differing),
        "command": " ".join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "(unset)"), "python",
                             "scripts/load_check_server.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    mean_batch = sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values()))
    print("| model | requests (concurrent) | requests/s | tokens/s | p50 s | p95 s | 2xx / 429 / 503 / other | "
          "mean batch | differ from alone |")
    print(f"| {name} ({record['model_type']}) | {args.requests} ({args.concurrency}) | {record['requests_per_s']} | "
          f"{record['generated_tokens_per_s']} | {record['p50_latency_s']} | {record['p95_latency_s']} | "
          f"{record['status_2xx']} / {record['status_429']} / {record['status_503']} / {record['status_other']} | "
          f"{mean_batch:.2f} | {record['differing_from_alone']} of {record['rechecked_alone']} |")
    print(json.dumps(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    lost = record["status_other"] + record["not_sent"]
    return 1 if lost or differing or not_alone else 0


if __name__ == "__main__":
    sys.exit(main())
