"""The doctor's text report and its figure."""

from __future__ import annotations

from typing import Any

from .verdict import ROUNDS, Measurements, Verdict, spread


def _v(x: Any, fmt: str = ".1f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def _s(x: Any, rounds: list[float] | None, fmt: str = ".1f", unit: str = "", scale: float = 1.0) -> str:
    """A figure with the range of its repeats: ``12.3 ms [11.9-13.0]`` (their median, lowest and
    highest; the figure itself where it has too few)."""
    if x is None:
        return "-"
    s = spread(rounds)
    if s is None:
        return f"{scale * x:{fmt}}{unit}"
    # Measured in rounds: their median, as the brackets (and the verdict) read them.
    return f"{scale * s.median:{fmt}}{unit} [{scale * s.lo:{fmt}}-{scale * s.hi:{fmt}}]"


def report_text(m: Measurements, v: Verdict) -> str:
    """The report: what was measured, then the verdict (its last section)."""
    load = f", load average {m.load_average:.1f}" if m.load_average is not None else ""
    if m.load_average_end is not None:
        load += f" (at the end {m.load_average_end:.1f})"
    lines = [f"feeder-doctor: {m.data} ({m.source_kind}, {m.samples} samples), batch {m.batch_size}, "
             f"transforms {m.transforms}, device {m.device}, {m.cores} cores{load}",
             f"feeder defaults here: decode_threads={m.decode_threads}, read_threads={m.read_threads}; "
             f"JPEG decoder {m.jpeg_decoder}{' (region decode)' if m.region_decode else ''}",
             "",
             "storage",
             f"  read, one thread: median {_v(m.read_ms, '.2f', ' ms')}, p90 {_v(m.read_ms_p90, '.2f', ' ms')}, "
             f"first read {_v(m.read_ms_first, '.2f', ' ms')}, same samples again "
             f"{_v(m.read_ms_again, '.2f', ' ms')}; {_v((m.bytes_per_sample or 0) / 1024, '.0f')} KiB a sample",
             f"  read rate with {m.storage_threads} concurrent readers: {_v(m.storage_rate, '.0f', ' img/s')} "
             f"({_v(m.storage_mib_s, '.1f', ' MiB/s')}); reads overlapped by a read stage: "
             f"{'yes' if m.read_threads else 'no (read_threads=0: reads run in the decode threads)'}",
             "",
             "CPU work per image (one thread)",
             f"  decode{' (with the crop, resize and flip fused into it)' if m.fused else ''} "
             f"{_s(m.decode_ms, m.decode_ms_rounds, '.2f', ' ms')}, transforms "
             f"{_s(m.transform_ms, m.transform_ms_rounds, '.2f', ' ms')}; "
             f"ceiling (cost x {m.cores} cores) {_v(m.ceiling_rate, '.0f', ' img/s')}",
             "",
             'the feeder alone ("auto" threads)',
             f"  {_s(m.loader_rate, m.loader_rate_rounds, '.0f', ' img/s')}, using "
             f"{_v(m.loader_cpu_cores, '.2f')} cores; "
             f"stage utilization "
             + ", ".join(f"{k} {100 * u:.0f}%" for k, u in m.stage_utilization.items())
             + f"; transfer {_v(m.transfer_ms, '.2f', ' ms')} a batch"]
    if m.model is not None:
        lines += ["", f"the model: {m.model}",
                  f"  synthetic input on {m.device}: {_s(m.step_ms, m.step_ms_rounds, '.2f', ' ms')} a "
                  f"step = {_v(m.model_rate, '.0f', ' img/s')} the loader must reach; the step used "
                  f"{_s(m.step_cpu_cores, m.step_cpu_cores_rounds, '.2f')} cores"
                  + (f" (torch threads {m.torch_threads})" if m.torch_threads is not None else "")
                  + (f"; GPU utilization {m.gpu_utilization:.0f}%" if m.gpu_utilization is not None else "")]
        for name, f in m.fed.items():
            extra = (f", {f.active_threads} decode threads active at the end"
                     if name == "tune" and f.active_threads is not None else "")
            lines.append(f"  fed ({name}): {_s(f.rate, f.rate_rounds, '.0f', ' img/s')}, loop waits "
                         f"{_s(f.wait_share, f.wait_share_rounds, '.1f', '%', 100)} of its time, step "
                         f"{_s(f.step_ms, f.step_ms_rounds, '.2f', ' ms')} = "
                         f"{_s(f.interference, f.interference_rounds, '.2f', 'x')} synthetic{extra}")
        lines.append(f"  (in [brackets]: the lowest and highest of {ROUNDS} rounds; tune: of the "
                     "parts of its run)")
        if m.tune_history:
            lines.append("  tune: active decode threads over time: "
                         + ", ".join(f"{n} at {t:.1f} s" for t, n in m.tune_history[:12])
                         + (" ..." if len(m.tune_history) > 12 else ""))
    else:
        lines += ["", "the model: none given (--model or --step-ms): the loader's own limit is judged"]
    if m.other_cores_run is not None:
        lines += ["", f"other processes used {m.other_cores_run:.2f} of the {m.cores} cores during the "
                  "run; by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in m.other_cores.items())]
    for note in m.notes:
        lines.append(f"note: {note}")
    lines += [""] + v.lines()
    return "\n".join(lines)


def plot(m: Measurements, v: Verdict, path: str) -> str | None:
    """``doctor.png``: time per image by part, the rates side by side, and CPU use
    over time by phase. None (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    parts = [("read (1 thread)", m.read_ms), ("decode", m.decode_ms), ("transforms", m.transform_ms)]
    if m.step_ms:
        parts.append(("model step / image", m.step_ms / m.batch_size))
    if m.transfer_ms:
        parts.append(("transfer / image", m.transfer_ms / m.batch_size))
    names = [p[0] for p in parts]
    ax = axes[0]
    ax.barh(names, [p[1] or 0 for p in parts], color="#4c72b0")
    ax.set_xlabel("ms per image")
    ax.set_title("where the time goes, per image")
    ax.invert_yaxis()
    rates = [("storage", m.storage_rate), ("CPU ceiling", m.ceiling_rate), ("loader alone", m.loader_rate)]
    if m.model_rate:
        rates.append(("model needs", m.model_rate))
    rates += [(f"fed ({k})", f.rate) for k, f in m.fed.items()]
    ax = axes[1]
    colors = ["#dd8452" if n == "model needs" else "#55a868" if n.startswith("fed") else "#4c72b0"
              for n, _ in rates]
    ax.barh([r[0] for r in rates], [r[1] or 0 for r in rates], color=colors)
    ax.set_xscale("log")  # storage can be 100x the rest
    ax.set_xlabel("images per second (log scale)")
    ax.set_title("the loader's rate against the model's")
    ax.invert_yaxis()
    ax = axes[2]
    phases: dict[str, list[tuple[float, float]]] = {}
    for row in m.timeline:
        phases.setdefault(row["phase"], []).append((row["t"], row["cpu_cores"]))
    for name, pts in phases.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linestyle="none", label=name)
    others = [(row["t"], row["other_cores"]) for row in m.timeline if "other_cores" in row]
    if others:
        ax.plot([p[0] for p in others], [p[1] for p in others], color="black", linewidth=0.8,
                label="other processes")
    ax.axhline(m.cores, color="grey", linestyle=":", label=f"{m.cores} cores")
    ax.set_xlabel("seconds")
    ax.set_ylabel("cores busy (the doctor and its worker process)")
    ax.set_title("CPU use over time")
    ax.legend(fontsize=7)
    fig.suptitle(f"feeder-doctor: bottleneck: {v.bottleneck}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
