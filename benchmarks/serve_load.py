"""Load on ``truespec serve``: N concurrent streaming chat clients for a fixed time, on loopback.

Starts the server as a real process (engine flags after ``--``), waits for /health, then runs ``--clients``
asyncio clients for ``--duration`` seconds: each sends streaming chat completions (``--max-tokens``, greedy,
ignore_eos) one after another and records, per request, the time to the first content chunk (TTFT) and the time
per output token after it (TPOT, from the usage chunk). At the end: requests, errors, output tok/s, TTFT and TPOT
p50 / p99, and the server's /metrics (running / waiting requests and KV usage must be back to 0). SIGTERM ends the
server; its exit code is reported.

    python3 benchmarks/serve_load.py --clients 32 --duration 60 -- --dtype float32 --max-num-seqs 32
"""

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPTS = ["Write a function that reverses a string.", "Explain what a hash map is.", "def fib(n):",
           "Sort a list of dicts by key.", "What does `yield` do in Python?", "Parse a CSV line."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def client(base: str, idx: int, deadline: float, max_tokens: int, rows: list[dict]) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        n = 0
        while time.monotonic() < deadline:
            body = {"model": "truespec-default", "stream": True, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": PROMPTS[(idx + n) % len(PROMPTS)]}]}
            start, first, tokens, error = time.monotonic(), None, 0, None
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        error = f"HTTP {resp.status_code}"
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                            first = time.monotonic()
            except Exception as e:  # noqa: BLE001 - counted as an error of the run
                error = f"{type(e).__name__}: {e}"
            end = time.monotonic()
            rows.append({"ttft": (first or end) - start, "tpot": (end - first) / (tokens - 1)
                         if first is not None and tokens > 1 else None, "tokens": tokens, "error": error})
            n += 1


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(truespec:\w+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("engine_args", nargs="*", help="after --: flags for truespec serve")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "truespec.entrypoints.cli", "serve", "--port", str(port), "--log-level", "warning",
           *args.engine_args]
    server = subprocess.Popen(cmd, env=os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rows: list[dict] = []
        start = time.monotonic()
        deadline = start + args.duration

        async def run() -> None:
            await asyncio.gather(*(client(base, i, deadline, args.max_tokens, rows) for i in range(args.clients)))

        asyncio.run(run())
        wall = time.monotonic() - start
        time.sleep(1.0)
        after = metrics(base)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    ok = [r for r in rows if r["error"] is None]
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    report = {"clients": args.clients, "duration_s": round(wall, 1), "requests": len(rows),
              "errors": len(rows) - len(ok), "first_errors": [r["error"] for r in rows if r["error"]][:5],
              "output_tok_per_s": sum(r["tokens"] for r in ok) / wall,
              "ttft_ms_p50": 1e3 * pct([r["ttft"] for r in ok], 0.5),
              "ttft_ms_p99": 1e3 * pct([r["ttft"] for r in ok], 0.99),
              "tpot_ms_p50": 1e3 * pct(tpots, 0.5), "tpot_ms_p99": 1e3 * pct(tpots, 0.99),
              "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else None,
              "after": {k: after.get(k) for k in ("truespec:num_requests_running", "truespec:num_requests_waiting",
                                                  "truespec:kv_cache_usage_perc")},
              "server_exit_code": code, "engine_args": args.engine_args}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
