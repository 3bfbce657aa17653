#!/usr/bin/env python3
"""Many questions about one long document, against an HTTP server (issue 29's workload).

The document is DOC random token ids (BOS first), each question QT more; question 1 runs alone
(the cold time to first token), then the other questions run N at a time. Prints one JSON line:
TTFT of question 1, p50/p95 of questions 2..Q, total time and, for kvsparse, the most KV bytes in
use and the bytes its prefix cache holds at the end (from /metrics).

  --api kvsparse   POST /v1/completions, token-id prompt, streamed; --context adds
                   "kvsparse": {"context_tokens": DOC} (compress the document once, keep it)
  --api llama      llama-server's POST /completion with "cache_prompt": true, streamed

Only the standard library: the same client for both servers.
"""
import argparse
import json
import random
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def stream_ttft(url, payload):
    """Seconds to the first server-sent event, and to the end of the stream."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    start = time.monotonic()
    first = None
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            if first is None:
                first = time.monotonic() - start
            if line == "data: [DONE]":
                break
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']}")
            if event.get("stop") is True:  # llama-server's last event
                break
    return first, time.monotonic() - start


def metric(base, name):
    try:
        body = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    except Exception:
        return None
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--api", choices=["kvsparse", "llama"], default="kvsparse")
    ap.add_argument("--context", action="store_true", help="kvsparse: compress the document once (context_tokens)")
    ap.add_argument("--doc", type=int, default=8192, help="document tokens (BOS included)")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    doc = [1] + [rng.randrange(3, args.vocab) for _ in range(args.doc - 1)]
    questions = [[rng.randrange(3, args.vocab) for _ in range(args.question_tokens)] for _ in range(args.questions)]

    def ask(i):
        tokens = doc + questions[i]
        if args.api == "kvsparse":
            payload = {"prompt": tokens, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}
            if args.context:
                payload["kvsparse"] = {"context_tokens": len(doc)}
            return stream_ttft(args.base + "/v1/completions", payload)
        payload = {"prompt": tokens, "n_predict": args.max_tokens, "temperature": 0, "stream": True,
                   "cache_prompt": True, "ignore_eos": True}
        return stream_ttft(args.base + "/completion", payload)

    peak = [0.0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            used = metric(args.base, "kvsparse_kv_bytes_used")
            if used is not None:
                peak[0] = max(peak[0], used)
            done.wait(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    if args.api == "kvsparse":
        watcher.start()
    start = time.monotonic()
    cold_ttft, _ = ask(0)
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        rest = list(pool.map(ask, range(1, args.questions)))
    total = time.monotonic() - start
    done.set()
    warm = [t for t, _ in rest]
    out = {
        "label": args.label, "api": args.api, "doc_tokens": args.doc, "questions": args.questions,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "ttft_q1_s": round(cold_ttft, 3),
        "ttft_rest_p50_s": round(statistics.median(warm), 3) if warm else None,
        "ttft_rest_p95_s": round(percentile(warm, 0.95), 3) if warm else None,
        "total_s": round(total, 2),
    }
    if args.api == "kvsparse":
        out["kv_bytes_used_peak"] = int(peak[0])
        out["prefix_cache_bytes_end"] = int(metric(args.base, "kvsparse_prefix_cache_bytes") or 0)
        out["prefix_cache_hits"] = int(metric(args.base, "kvsparse_prefix_cache_hits_total") or 0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
