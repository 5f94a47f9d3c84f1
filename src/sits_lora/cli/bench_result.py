"""The results of ``sits-lora bench`` (``BenchmarkRunner`` in ``bench``): the items, the table, the JSON and the
summary chart."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Optional

from ..utils.units import GIB, KIB, MIB, format_rate

STATUSES = ("ok", "measured", "warning", "violated", "skipped", "not applicable", "error")
# Beyond this run-to-run spread the timings cannot test a rule: the verdict is "inconclusive".
MAX_SPREAD = 0.5


@dataclass
class BenchItem:
    """One measurement: its value (in ``unit``), a status from STATUSES, a one-line summary, the raw numbers."""

    section: str
    name: str
    status: str
    value: Optional[float] = None
    unit: str = ""
    summary: str = ""
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rate_text(value: Optional[float], unit: str) -> str:
    """A measured value as the table prints it: rates scaled (GB/s, TFLOP/s), other units to a few digits."""
    if value is None:
        return ""
    if unit not in ("B/s", "FLOP/s"):
        return f"{value:,.1f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return format_rate(value, unit)


def size_text(n: int) -> str:
    """A transfer size in KiB, MiB or GiB."""
    return f"{n // GIB} GiB" if n >= GIB else (f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB")


@dataclass
class BenchmarkResult:
    """Every item of a run, with the machine it ran on; ``passed`` is False on a violation or an error."""

    backend: str
    device: str
    settings: dict
    environment: dict
    items: list[BenchItem]
    seconds: float

    @property
    def passed(self) -> bool:
        return not any(item.status in ("violated", "error") for item in self.items)

    def item(self, section: str, name: str) -> BenchItem:
        for it in self.items:
            if it.section == section and it.name == name:
                return it
        raise KeyError(f"no item {name!r} in section {section!r}")

    def to_dict(self) -> dict:
        counts = {s: sum(1 for i in self.items if i.status == s) for s in STATUSES}
        return {
            "command": "bench",
            "passed": self.passed,
            "backend": self.backend,
            "device": self.device,
            "settings": self.settings,
            "environment": self.environment,
            "seconds": self.seconds,
            "counts": {k: v for k, v in counts.items() if v},
            "items": [i.to_dict() for i in self.items],
        }

    def save_json(self, path: str) -> str:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        os.replace(tmp, path)
        return path

    def table(self) -> str:
        rows = [("section", "item", "status", "value", "summary")]
        for i in self.items:
            value = rate_text(i.value, i.unit) if i.value is not None else ""
            rows.append((i.section, i.name, i.status, value, i.summary))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = [f"sits-lora bench: {self.device} ({self.backend}), {self.seconds:.1f} s, "
                 f"git {self.environment.get('git_revision')}"]
        for n, r in enumerate(rows):
            lines.append("  ".join(r[c].ljust(widths[c]) for c in range(4)) + "  " + r[4])
            if n == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 7)
        pcie = [i for i in self.items if i.section == "pcie" and "sizes" in i.details]
        if pcie:
            sizes = [row["bytes"] for row in pcie[0].details["sizes"]]
            head = ["transfer"] + [size_text(s) for s in sizes]
            body = [[i.name] + [rate_text(row["bandwidth"], "B/s") for row in i.details["sizes"]] for i in pcie]
            w = [max(len(r[c]) for r in [head] + body) for c in range(len(head))]
            lines += ["", "PCIe bandwidth by transfer size"] + ["  ".join(v.ljust(w[c]) for c, v in enumerate(r))
                                                              for r in [head] + body]
        bad = [f"{i.section}/{i.name}" for i in self.items if i.status in ("violated", "error")]
        lines += ["", "verdict: " + ("pass" if not bad else "FAIL: " + ", ".join(bad))]
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """A 2 x 2 summary chart: bandwidths, matmul rates, PCIe by size, INT4 latency by offset."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
        mem = [i for i in self.items if i.section == "device memory" and i.unit == "B/s" and i.value]
        ax = axes[0][0]
        if mem:
            ax.barh([i.name for i in mem], [i.value / 1e9 for i in mem], color="#4c72b0")
            ceiling = next((i.value for i in mem if i.name.startswith("copy bandwidth")), None)
            if ceiling:
                ax.axvline(ceiling / 1e9, color="k", ls="--", lw=1, label="copy bandwidth (ceiling)")
                ax.legend(loc="lower right", fontsize=8)
            ax.invert_yaxis()
        _panel(ax, "memory bandwidth achieved (GB/s)", bool(mem), self._reason("device memory"))
        ax = axes[0][1]
        rates = [i for i in self.items if i.section == "device memory" and i.unit == "FLOP/s" and i.value]
        if rates:
            ax.bar([i.name for i in rates], [i.value / 1e12 for i in rates], color="#55a868")
            for n, i in enumerate(rates):
                ax.text(n, i.value / 1e12, f"{i.value / 1e12:.3g}", ha="center", va="bottom", fontsize=8)
        _panel(ax, "matmul rate (TFLOP/s)", bool(rates), self._reason("device memory"))
        ax = axes[1][0]
        pcie = [i for i in self.items if i.section == "pcie" and "sizes" in i.details]
        for i in pcie:
            sizes = i.details["sizes"]
            ax.plot([s["bytes"] for s in sizes], [s["bandwidth"] / 1e9 for s in sizes], marker="o", label=i.name)
        if pcie:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("transfer size (bytes)")
            ax.legend(fontsize=8)
        _panel(ax, "PCIe bandwidth (GB/s)", bool(pcie), self._reason("pcie"))
        ax = axes[1][1]
        offsets = [i for i in self.items if i.section == "int4 alignment" and i.name.startswith("offset")]
        if offsets:
            colors = ["#4c72b0" if i.details.get("obeys_rule", True) else "#c44e52" for i in offsets]
            ax.bar([str(i.details["offset"]) for i in offsets], [i.value for i in offsets], color=colors)
            ax.set_xlabel("byte offset of the packed buffer (red: breaks the rule)")
            base = offsets[0].value
            tol = next((i.details.get("tolerance") for i in self.items if i.name.startswith("rule")), None)
            if base and tol and tol <= MAX_SPREAD:
                ax.axhspan(base, base * (1 + tol), color="0.85", zorder=0, label=f"offset 0 + {tol:.0%} (noise)")
                ax.legend(fontsize=8)
        _panel(ax, "INT4 load + dequantize latency (µs)", bool(offsets), self._reason("int4 alignment"))
        env = self.environment
        fig.suptitle(f"sits-lora bench: {self.device} ({self.backend}); torch {env.get('torch')}, triton "
                     f"{env.get('triton')}, git {env.get('git_revision')}, {env.get('date')}", fontsize=10)
        fig.tight_layout()
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def _reason(self, section: str) -> str:
        reasons = [i.summary for i in self.items if i.section == section and i.status in ("not applicable", "skipped")]
        return reasons[0] if reasons else "no measurement"


def _panel(ax, title: str, has_data: bool, reason: str) -> None:
    ax.set_title(title, fontsize=10)
    if not has_data:
        ax.text(0.5, 0.5, "\n".join(_wrap(reason, 50)), ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + len(word) + 1 > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + [line] if line else lines
