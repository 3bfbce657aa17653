#!/usr/bin/env python3
# Plots of a kvsparse bench results file (JSON lines). Usage: plot_bench.py results.jsonl OUT_DIR
import json, os, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out = sys.argv[2]
written = []

def label(r):
    return r["method"] + (" " + r["budget"] if r["budget"] else "") + (" " + r["kv_type"] if r["kv_type"] else "")

# Accuracy vs KV memory, one figure per (model, task, protocol); the Pareto frontier is the
# upper-left envelope: no other point has less memory and more accuracy.
groups = {}
for r in rows:
    if "accuracy" in r:
        groups.setdefault((r["model"], r["task"], r["protocol"]), []).append(r)
for (model, task, protocol), rs in sorted(groups.items()):
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    methods = sorted({r["method"] for r in rs})
    for m in methods:
        pts = [(100 * r["kv_ratio"], 100 * r["accuracy"]) for r in rs if r["method"] == m]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=m, s=28)
    pts = sorted((100 * r["kv_ratio"], 100 * r["accuracy"]) for r in rs)
    frontier, best = [], -1.0
    for x, y in pts:
        if y > best:
            frontier.append((x, y))
            best = y
    ax.plot([p[0] for p in frontier], [p[1] for p in frontier], "k--", lw=1, drawstyle="steps-post",
            label="Pareto frontier")
    ax.set_xlabel("KV memory, % of dense f16")
    ax.set_ylabel("accuracy %")
    ax.set_ylim(-3, 103)
    ax.set_title(f"{task} ({protocol}), {model}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    name = re.sub(r"[^\w.-]", "_", f"{task}_{protocol}" + (f"_{model}" if len({r["model"] for r in rows if "accuracy" in r}) > 1 else ""))
    path = os.path.join(out, f"accuracy_vs_kv_{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

# Latency vs context length per method configuration.
lat = [r for r in rows if r["task"] == "latency" and r.get("decode_ms")]
if lat:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for lab in sorted({label(r) for r in lat}):
        rs = sorted((r for r in lat if label(r) == lab), key=lambda r: r["length"])
        a1.plot([r["length"] for r in rs], [r["decode_ms"]["median"] for r in rs], marker="o", label=lab)
        a2.plot([r["length"] for r in rs], [r["ttft_ms"]["median"] for r in rs], marker="o", label=lab)
    a1.set_xlabel("context tokens"); a1.set_ylabel("decode ms / token (median)"); a1.set_xscale("log", base=2)
    a2.set_xlabel("context tokens"); a2.set_ylabel("time to first token, ms"); a2.set_xscale("log", base=2)
    a1.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "latency_vs_length.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

# Kept tokens per layer (after the prompt), longest length, first question task or latency rows.
per_layer = [r for r in rows if r.get("layer_live_tokens")]
if per_layer:
    longest = max(r["length"] for r in per_layer)
    task = next((r["task"] for r in per_layer if "accuracy" in r), per_layer[0]["task"])
    rs = [r for r in per_layer if r["length"] == longest and r["task"] == task and r["protocol"] in ("question_last", "-")]
    if rs:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for r in rs:
            ax.plot(range(len(r["layer_live_tokens"])), r["layer_live_tokens"], marker=".", label=label(r))
        ax.set_xlabel("layer"); ax.set_ylabel("live tokens after the prompt")
        ax.set_title(f"kept tokens per layer: {task}, {longest} tokens", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = os.path.join(out, "layer_kept_tokens.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

for p in written:
    print(p)
