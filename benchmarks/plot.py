"""Plot and tabulate the benchmarks' JSON results.

    python -m benchmarks.plot benchmarks/results/generate_run{1,2}.json \
        --attention benchmarks/results/attention.json --png benchmarks/results/tokens_per_s.png

Writes a PNG of tokens/s against batch size for every system (one panel per model and prompt
length) and prints markdown tables. Where several files hold the same (model, system, prompt,
batch), the plot shows the later file's run; the tables list every run. notebooks/benchmarks.ipynb
draws the same figure with ``figure(load(plotted_paths()))``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import fmt

STYLE = {"torch_cp": ("tab:red", "o"), "torch_cp_overlap": ("tab:pink", "o"),
         "torch_cp_compiled": ("darkred", "*"), "hf_static": ("tab:blue", "s"),
         "compiled_loop": ("tab:purple", "D"), "hf_dynamic": ("tab:green", "^"),
         "generate_batch": ("tab:orange", "v")}


RESULTS = Path(__file__).resolve().parent / "results"
# The generate runs BENCHMARKS.md's tokens/s plot is drawn from, in run order.
PLOTTED_RUNS = ("1", "2", "17", "18a", "20", "22", "23", "24", "25", "26a", "26b", "28", "30", "32")


def plotted_paths() -> list[Path]:
    """The JSON files of ``PLOTTED_RUNS`` in benchmarks/results/, in run order."""
    return [RESULTS / f"generate_run{run}.json" for run in PLOTTED_RUNS]


def load(paths: list[str | Path]) -> list[dict]:
    """Every record of ``paths``; ``run`` is the number in a ``generate_runN`` file name (else
    the file's position)."""
    records = []
    for position, path in enumerate(paths, 1):
        data = json.loads(Path(path).read_text())
        named = re.search(r"run(\w+)$", Path(path).stem)
        run = named.group(1) if named else str(position)
        for r in data["records"]:
            records.append(dict(r, run=run, copy_tb_s=data["copy_tb_s"]))
    return records


def plot(records: list[dict], png: str) -> None:
    """Write ``figure(records)`` to ``png`` (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    figure(records).savefig(png, dpi=120)


def figure(records: list[dict]):
    """The tokens/s against batch size figure (a matplotlib ``Figure``) of ``load``'s records:
    one panel per (model, prompt), each system's latest run at each batch size."""
    import matplotlib.pyplot as plt

    done = [r for r in records if "tokens_per_s" in r]
    panels = sorted({(r["model"], r["prompt"]) for r in done})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (model, prompt) in zip(axes[0], panels):
        latest: dict[tuple[str, int], dict] = {}
        for r in done:
            if (r["model"], r["prompt"]) == (model, prompt):
                latest[(r["system"], r["batch"])] = r
        for system, (color, marker) in STYLE.items():
            points = sorted((b, r["tokens_per_s"]) for (s, b), r in latest.items() if s == system)
            if points:
                ax.plot(*zip(*points), color=color, marker=marker, label=system)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_title(f"{model}, prompt {prompt}, 128 new tokens", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("tokens/s (generated, whole call)")
    labels = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(labels.values(), labels.keys(), loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle("H200, bf16, greedy, no EOS: tokens/s against batch size", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def cell(value) -> str:
    return fmt(value, missing="")


def _run_order(run: str) -> tuple[int, str]:
    digits = re.match(r"\d*", run).group()
    return int(digits or 0), run


def generate_table(records: list[dict]) -> str:
    cols = ["run", "model", "prompt", "batch", "system", "tokens/s", "ms/step", "roofline ms",
            "step/roofline", "TTFT s", "peak GiB", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    order = {s: i for i, s in enumerate(STYLE)}
    for r in sorted(records, key=lambda r: (r["model"], r["prompt"], r["batch"],
                                             order.get(r["system"], 9), _run_order(r["run"]))):
        note = r.get("skipped") or (r.get("error", "")[:80] if "error" in r else "")
        if r.get("warmup_s"):
            note = f"warm-up call {r['warmup_s']:.0f} s"
        lines.append("| " + " | ".join(cell(v) for v in (
            r["run"], r["model"], r["prompt"], r["batch"], r["system"], r.get("tokens_per_s"),
            r.get("step_ms"), r["roofline_ms"], r.get("step_over_roofline"), r.get("ttft_s"),
            r.get("peak_gib"), note)) + " |")
    return "\n".join(lines)


def attention_table(path: str) -> str:
    data = json.loads(Path(path).read_text())
    cols = ["shape", "batch x ctx", "unplaced ms", "KV TB/s", "KV / copy", "P=1 ms",
            "P=2 ms", "P=2 ratio", "P=4 ms", "P=4 ratio", "merge P=2/4 us (torch_cp)",
            "merge P=2/4 us (FlashInfer)", "whole P=1 ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in data["records"]:
        if "placed" not in r:
            continue
        p = r["placed"]
        copy = data["copy_tb_s"]
        m = [p[k]["merge"] for k in ("2", "4")]
        lines.append("| " + " | ".join(cell(v) for v in (
            r["shape"], f"{r['batch']} x {r['ctx']}", r["unplaced_best_ms"],
            r["unplaced_kv_tb_s"], r["unplaced_kv_tb_s"] / copy, p["1"]["ms"], p["2"]["ms"],
            p["2"]["ratio_to_ideal"], p["4"]["ms"], p["4"]["ratio_to_ideal"],
            f"{m[0]['graph_ms'] * 1e3:.0f} / {m[1]['graph_ms'] * 1e3:.0f}",
            f"{m[0]['flashinfer_graph_ms'] * 1e3:.1f} / {m[1]['flashinfer_graph_ms'] * 1e3:.1f}",
            p["1"]["whole_graph_ms"])) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("generate", nargs="*", help="generate.py JSON files, in run order")
    ap.add_argument("--attention", help="attention.py JSON file")
    ap.add_argument("--png", help="write the tokens/s plot here")
    args = ap.parse_args(argv)
    if args.attention:
        print(attention_table(args.attention), end="\n\n")
    if args.generate:
        records = load(args.generate)
        print(generate_table(records))
        if args.png:
            plot(records, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
