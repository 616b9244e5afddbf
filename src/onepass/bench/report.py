"""The benchmark's outputs: a Markdown table laid out like the paper's, and PNG plots.

Why this module exists: measuring (``bench.py``) and presenting are separate
concerns; this turns ``summary.json`` into what a reader compares with the
paper: speed and memory relative to packed N-pass, beside the paper's figures.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from onepass.bench.ratio import SpeedRatio

# The paper (Goru, Mehta, Jain 2025): Qwen3 4B/8B/32B, QLoRA, one H100, FlexAttention.
PAPER = {
    "one-pass-packed": {"speedup": "1.44-1.54x", "memory": "1.29-1.34x"},
    "n-pass-packed": {"speedup": "1.00x", "memory": "1.00x"},
}


def _fmt(x: Any, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown(summary: dict[str, Any]) -> str:
    dev, ver, wl = summary["device"], summary["versions"], summary["workload"]
    lines = [
        f"Device: {dev['device']} ({dev['gpu'] or dev['cpu']}, {dev['threads']} threads); "
        f"torch {ver['torch']}, transformers {ver['transformers']}",
        f"Workload: {wl['name']}: {wl['conversations']} conversations, {wl['views']} views, "
        f"model {wl['model_shape']}{_arch(wl)} ({wl['dtype']}), max_tokens {wl['max_tokens']}, "
        f"{wl['repeats']} timed epochs after warm-up; ideal speedup "
        + ", ".join(f"{g} {v:.2f}x" for g, v in summary["ideal_speedup"].items()),
        f"Matmul peak measured in this run: {summary['matmul_peak_flops'] / 1e9:.1f} GFLOP/s",
        "",
        "| setting | backend | depth | conv/s | tokens/s | speedup vs N-pass packed | paper | vs TRL SFT | "
        "peak memory (MiB) | memory vs N-pass packed | paper | fraction of ideal | useful-FLOP util. | spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary["settings"]:
        paper = PAPER.get(s["setting"], {}) if s["depth_group"] == "all" else {}
        mem = s["peak_memory_bytes"]
        lines.append(" | ".join([
            f"| {s['setting']}", s["backend"], s["depth_group"], _fmt(s["conversations_per_s"], ".2f"),
            _fmt(s["tokens_per_s"], ",.0f"), _fmt(s["speedup_vs_n_pass_packed"], ".2f", "x")
            + (" (disturbed timing)" if (c := speed_check(s)) and c.disturbed else ""),
            paper.get("speedup", "-"), _fmt(s.get("speedup_vs_trl"), ".2f", "x"),
            _fmt(mem / 2**20 if mem else None, ",.0f"),
            _fmt(s["memory_vs_n_pass_packed"], ".2f", "x"), paper.get("memory", "-"),
            _fmt(s["fraction_of_ideal"], ".0%"), _fmt(s["useful_flop_utilisation"], ".0%"),
            _fmt(s["epoch_seconds_spread"], ".1%") + " |"]))
    lines += ["", *headline(summary), *shared_headline(summary)]
    return "\n".join(lines) + "\n"


def _arch(workload: dict[str, Any]) -> str:
    arch = workload.get("arch", "qwen3")
    return "" if arch == "qwen3" else f" {arch} (FLOPs, ideal and utilisation counted as Qwen3's)"


def headline(summary: dict[str, Any]) -> list[str]:
    """One line per backend and depth group: one-pass packed against the N-pass baselines."""
    out = []
    for s in summary["settings"]:
        if s["setting"] != "one-pass-packed":
            continue
        checked = speed_check(s)
        if checked is not None and checked.disturbed:  # past what the work allows: no speedup quoted
            speed = checked.describe("one-pass packed", f"N-pass packed ({s['backend']}, {s['depth_group']})")
            line = f"- {speed}"
        else:
            line = (f"- one-pass packed vs N-pass packed ({s['backend']}, {s['depth_group']}): "
                    f"{_fmt(s['speedup_vs_n_pass_packed'], '.2f', 'x')}, "
                    f"{_fmt(s['fraction_of_ideal'], '.0%')} of the ideal "
                    f"{summary['ideal_speedup'].get(s['depth_group'], 0):.2f}x"
                    + (f" (fastest epochs: {s['best_epoch_speedup_vs_n_pass_packed']:.2f}x, "
                       f"{s['best_epoch_fraction_of_ideal']:.0%})" if s.get("best_epoch_fraction_of_ideal") else "")
                    + (f", within the FLOP/token bound of {checked.bound:.2f}x" if checked is not None else ""))
        line += f"; memory {_fmt(s['memory_vs_n_pass_packed'], '.2f', 'x')}"
        if s.get("tensor_memory_vs_n_pass_packed"):  # onepass.bench.memory: allocator-level, not RSS
            line += (f" (RSS); tensors {s['tensor_memory_vs_n_pass_packed']:.2f}x, forward+backward "
                     f"{s['forward_backward_memory_vs_n_pass_packed']:.2f}x")
        if s.get("recurrent_chain_calls"):
            line += (f"; state passing {s['state_passing_fraction_of_step']:.1%} of the step (recurrent mixers "
                     f"{s['recurrent_mixer_fraction_of_step']:.1%}, {s['recurrent_chain_calls']} calls per epoch)")
        if s.get("speedup_vs_flash_n_pass_packed"):  # the FA2-class baseline (onepass.attention.varlen)
            flash = speed_check(s, "flash_n_pass_packed")
            line += (f"; vs N-pass packed on torch's flash varlen kernel: {s['speedup_vs_flash_n_pass_packed']:.2f}x"
                     + (f" (disturbed timing: past the FLOP/token bound of {flash.bound:.2f}x)"
                        if flash is not None and flash.disturbed else "")
                     + (f", memory {s['memory_vs_flash_n_pass_packed']:.2f}x"
                        if s.get("memory_vs_flash_n_pass_packed") else ""))
        if s.get("speedup_vs_trl"):
            line += f"; vs TRL SFTTrainer packed N-pass: {s['speedup_vs_trl']:.2f}x"
        if s.get("speedup_vs_trl_tuned"):
            line += f"; vs TRL tuned (checkpointing off, {tuned_backend(summary)}): {s['speedup_vs_trl_tuned']:.2f}x"
        out.append(line)
    return out


def shared_headline(summary: dict[str, Any]) -> list[str]:
    """One line per backend and depth group: prefixes shared across conversations against the one-pass
    packed rows they merge (one tree per conversation), and the FLOP bound of that."""
    out = []
    for s in summary["settings"]:
        if s.get("speedup_vs_one_pass_packed") is None:
            continue
        checked = speed_check(s, "one_pass_packed")
        what = f"shared prefixes vs one-pass packed ({s['backend']}, {s['depth_group']})"
        if checked is not None and checked.disturbed:
            line = "- " + checked.describe("shared prefixes", f"one-pass packed ({s['backend']}, {s['depth_group']})")
        else:
            line = (f"- {what}: {s['speedup_vs_one_pass_packed']:.2f}x"
                    + (f" (fastest epochs {s['best_epoch_speedup_vs_one_pass_packed']:.2f}x)"
                       if s.get("best_epoch_speedup_vs_one_pass_packed") else "")
                    + (f", {s['fraction_of_shared_bound']:.0%} of its FLOP bound {s['shared_bound']:.2f}x"
                       + (f" (fastest: {s['best_epoch_fraction_of_shared_bound']:.0%})"
                          if s.get("best_epoch_fraction_of_shared_bound") else "") if s.get("shared_bound") else ""))
        if s.get("cpu_speedup_vs_one_pass_packed"):  # process CPU time: what neighbours on the cores distort least
            line += (f"; CPU time {s['cpu_speedup_vs_one_pass_packed']:.2f}x (fastest epochs "
                     f"{s['best_cpu_epoch_speedup_vs_one_pass_packed']:.2f}x)"
                     + (f", {s['cpu_fraction_of_shared_bound']:.0%} of the bound (fastest: "
                        f"{s['best_cpu_epoch_fraction_of_shared_bound']:.0%})" if s.get("shared_bound") else ""))
        if s.get("tensor_memory_vs_one_pass_packed"):
            line += f"; peak tensors {s['tensor_memory_vs_one_pass_packed']:.2f}x"
        line += (f"; {s['tokens']:,} tokens in {s['rows']} rows; vs N-pass packed "
                 f"{_fmt(s['speedup_vs_n_pass_packed'], '.2f', 'x')}")
        out.append(line)
    return out


def speed_check(setting: dict[str, Any], baseline: str = "n_pass_packed") -> SpeedRatio | None:
    """The setting's checked speed ratio vs ``baseline`` (``n_pass_packed``, same backend, or
    ``flash_n_pass_packed``, torch's flash varlen kernel), as ``summary.json`` holds it (None: not measured)."""
    d = setting.get(f"speed_ratio_vs_{baseline}")
    if d and "fastest" not in d and "best" in d:  # a summary written before the field was named for what it is
        d = {**d, "fastest": d["best"]}
    return SpeedRatio(**{f.name: d[f.name] for f in fields(SpeedRatio)}) if d else None


def tuned_backend(summary: dict[str, Any]) -> str:
    return next((s["backend"] for s in summary["settings"] if s["setting"] == "trl-sft-packed-tuned"), "-")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plots(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """speed per setting (figure 3 style), the K-pass trade-off, and speedup by depth group."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    out = []
    settings = [s for s in summary["settings"] if s["depth_group"] == "all"]
    backends = sorted({s["backend"] for s in settings})

    fig = Figure(figsize=(10, 7.5))
    ax_abs, ax = fig.subplots(2, 1, sharex=True)
    names = list(dict.fromkeys(s["setting"] for s in settings))
    width = 0.8 / max(1, len(backends))
    for j, b in enumerate(backends):
        xs = [i + j * width for i in range(len(names))]
        absolute = {s["setting"]: s["conversations_per_s"] for s in settings if s["backend"] == b}
        vals = {s["setting"]: s["speedup_vs_n_pass_packed"] or 0 for s in settings if s["backend"] == b}
        ax_abs.bar(xs, [absolute.get(n, 0) for n in names], width, label=b)
        ax.bar(xs, [vals.get(n, 0) for n in names], width, label=b)
    ax_abs.set_ylabel("conversations / s")
    ax_abs.set_title(f"{summary['workload']['name']}: training throughput (higher is better)")
    ax_abs.legend()
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("vs N-pass packed, same backend")
    ax.set_title("relative to N-pass packed (the paper's column)")
    out.append(_save(fig, out_dir / "speedup.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for b in backends:
        ks, sp, mem = [], [], []
        for s in settings:
            if s["backend"] != b:
                continue
            k = {"n-pass-packed": None, "one-pass-packed": 1}.get(s["setting"])
            if s["setting"].startswith("k-pass-"):
                k = int(s["setting"].split("-")[2])
            if k is not None:
                ks.append(k)
                sp.append(s["speedup_vs_n_pass_packed"] or 0)
                mem.append(s["memory_vs_n_pass_packed"] or 0)
        order = sorted(range(len(ks)), key=ks.__getitem__)
        ax.plot([ks[i] for i in order], [sp[i] for i in order], "o-", label=f"speed ({b})")
        ax.plot([ks[i] for i in order], [mem[i] for i in order], "s--", label=f"memory ({b})")
    ax.set_xlabel("K (passes per conversation; 1 = one-pass)")
    ax.set_ylabel("relative to N-pass packed")
    ax.set_title("K-pass trade-off")
    ax.legend()
    out.append(_save(fig, out_dir / "k_pass.png"))

    shared = [s for s in summary["settings"] if s.get("speedup_vs_one_pass_packed") is not None]
    if shared:
        out.append(_shared_plot(summary, shared, out_dir))

    groups = [s for s in summary["settings"] if s["depth_group"] != "all" and s["setting"] == "one-pass-packed"]
    if groups:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for b in backends:
            g = [s for s in groups if s["backend"] == b]
            ax.bar([s["depth_group"] for s in g], [s["speedup_vs_n_pass_packed"] or 0 for s in g],
                   alpha=0.7, label=b)
        ideal = summary["ideal_speedup"]
        ax.plot([s["depth_group"] for s in groups[: len(ideal)]],
                [ideal.get(s["depth_group"], 0) for s in groups[: len(ideal)]], "k_", ms=30, label="ideal")
        ax.set_ylabel("one-pass packed vs N-pass packed")
        ax.set_title("speedup by conversation depth (G1 1-5, G2 6-7, G3 8-16 turns)")
        ax.legend()
        out.append(_save(fig, out_dir / "depth_groups.png"))
    return out


def _shared_plot(summary: dict[str, Any], shared: list[dict[str, Any]], out_dir: Path) -> Path:
    """Shared prefixes against one-pass packed, per backend and depth group: median and fastest-epoch
    speedups (wall clock; fastest also in process CPU time) beside the FLOP bound, and peak tensor memory."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    labels = [f"{s['backend']}\n{s['depth_group']}" for s in shared]
    x = range(len(shared))
    ax.bar([i - 0.3 for i in x], [s["speedup_vs_one_pass_packed"] for s in shared], 0.2, label="median epochs")
    ax.bar([i - 0.1 for i in x], [s.get("best_epoch_speedup_vs_one_pass_packed") or 0 for s in shared], 0.2,
           label="fastest epochs")
    ax.bar([i + 0.1 for i in x], [s.get("best_cpu_epoch_speedup_vs_one_pass_packed") or 0 for s in shared], 0.2,
           label="fastest epochs, process CPU time")
    ax.bar([i + 0.3 for i in x], [s.get("tensor_memory_vs_one_pass_packed") or 0 for s in shared], 0.2,
           label="peak tensor memory", color="#9e9e9e")
    ax.hlines([s.get("shared_bound") or 0 for s in shared], [i - 0.42 for i in x], [i + 0.42 for i in x],
              colors="k", linestyles="dashed", label="FLOP bound")
    ax.axhline(1.0, color="grey", lw=0.8)
    top = max(max(s["speedup_vs_one_pass_packed"], s.get("shared_bound") or 0) for s in shared)
    ax.set_ylim(0, top * 1.45)  # room for the legend above the bars
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("vs one-pass packed (one tree per conversation)")
    ax.set_title(f"{summary['workload']['name']}: prefixes shared across conversations, same row budget")
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    return _save(fig, out_dir / "shared.png")
