"""What this machine can do, measured once per device and cached on disk.

On a CUDA device: name, memory, compute capability, FP8 support, and four measurements:
HBM bandwidth (a device-to-device copy, read + write counted), host->device and device->host
bandwidth over pinned memory, and the bf16 matmul rate (an 8192³ GEMM, 4096³ when memory is
short), plus the fp8 ``torch._scaled_mm`` rate where the GPU has fp8 tensor cores; each measured by
``sits_lora.utils.device_probe`` (medians of CUDA-event timings). Measurements take about a second
and are cached in ``$SITS_LORA_CACHE/hardware/`` (default ``~/.cache/sits_lora/hardware/``) under a
key of device name, UUID, torch and CUDA versions, so a restarted run reads them back. Free memory is
read live every time. A CPU machine reports the CPU and its memory and measures nothing: the GPU
checks are skipped there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..utils import device_probe
from ..utils.cache import cache_root
from ..utils.env import cpu_name
from ..utils.units import GIB, format_rate


# Sizes of the measurements. Large enough to reach the plateau on a Hopper GPU (at several TB/s a 512 MiB copy
# still lasts far longer than a launch; an 8192³ bf16 GEMM is about a TFLOP of work), small enough that all of
# them together take about a second.
_COPY_BYTES = 512 * 2**20
_PINNED_BYTES = 256 * 2**20


@dataclass
class HardwareReport:
    """The device a run trains on. Bandwidths in bytes/s, rates in FLOP/s, memory in bytes."""

    device: str
    name: str
    total_memory: int
    free_memory: int
    compute_capability: Optional[str] = None
    fp8_supported: Optional[bool] = None
    hbm_bandwidth: Optional[float] = None
    h2d_bandwidth: Optional[float] = None
    d2h_bandwidth: Optional[float] = None
    matmul_flops: Optional[float] = None
    fp8_matmul_flops: Optional[float] = None
    cpu_cores: Optional[int] = None
    measured_at: Optional[str] = None
    from_cache: bool = False
    cache_file: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def pinned_bandwidth(self) -> Optional[float]:
        """The slower direction of host<->device over pinned memory: what a round trip is limited by."""
        values = [v for v in (self.h2d_bandwidth, self.d2h_bandwidth) if v]
        return min(values) if values else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """A short aligned table, one quantity per line."""
        rows = [("device", f"{self.name} ({self.device})")]
        rows.append(("memory", f"{self.total_memory / GIB:.1f} GiB total, {self.free_memory / GIB:.1f} GiB free"))
        if self.is_cuda:
            rows.append(("compute capability", f"{self.compute_capability}, FP8 {'yes' if self.fp8_supported else 'no'}"))
            rows.append(("HBM bandwidth", format_rate(self.hbm_bandwidth or None, "B/s") + " (copy, read + write)"))
            rows.append(("host->device (pinned)", format_rate(self.h2d_bandwidth or None, "B/s")))
            rows.append(("device->host (pinned)", format_rate(self.d2h_bandwidth or None, "B/s")))
            rows.append(("bf16 matmul", format_rate(self.matmul_flops or None, "FLOP/s")))
            if self.fp8_matmul_flops:
                rows.append(("fp8 matmul", format_rate(self.fp8_matmul_flops or None, "FLOP/s")))
            rows.append(("measured", f"{self.measured_at}" + (" (cached)" if self.from_cache else "")))
        else:
            rows.append(("cores", str(self.cpu_cores)))
        rows.extend(("note", n) for n in self.notes)
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def default_cache_dir() -> Path:
    """``$SITS_LORA_CACHE/hardware`` (default ``~/.cache/sits_lora/hardware``)."""
    return cache_root() / "hardware"


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages


def _measure_cuda(device: torch.device, free: int) -> dict:
    out: dict = {}
    with torch.cuda.device(device):
        copy_bytes = _COPY_BYTES if free > 6 * _COPY_BYTES else max(free // 8, 2**20)
        out["hbm_bandwidth"], _ = device_probe.copy_bandwidth(device, copy_bytes)
        out["h2d_bandwidth"], _ = device_probe.pinned_bandwidth(device, _PINNED_BYTES, "host->device")
        out["d2h_bandwidth"], _ = device_probe.pinned_bandwidth(device, _PINNED_BYTES, "device->host")

        n = 8192 if free > 8 * 8192 * 8192 * 2 else 4096
        out["matmul_flops"], _ = device_probe.matmul_rate(device, n, torch.bfloat16)

        major, minor = torch.cuda.get_device_capability(device)
        out["fp8_supported"] = False
        if (major, minor) >= (8, 9) and hasattr(torch, "float8_e4m3fn"):
            a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            try:
                # e4m3fn only: the format sits_lora's fp8 base trains in (ops.fp8.E4M3)
                out["fp8_matmul_flops"], _, _ = device_probe.fp8_matmul_rate(a, b, formats=("float8_e4m3fn",))
                out["fp8_supported"] = True
            except device_probe.Fp8MatmulError as failed:
                _, error = failed.errors[0]
                text = (str(error).splitlines() or [type(error).__name__])[0]
                out["notes"] = [f"fp8: torch._scaled_mm failed ({text[:120]})"]
            del a, b
        torch.cuda.empty_cache()
    return out


def _cache_key(device: torch.device) -> tuple[str, dict]:
    props = torch.cuda.get_device_properties(device)
    fields = {
        "name": props.name,
        "uuid": str(getattr(props, "uuid", "")),
        "total_memory": props.total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return digest, fields


_MEASURED_FIELDS = ("hbm_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "matmul_flops", "fp8_matmul_flops",
                    "fp8_supported", "measured_at", "notes")


def probe_hardware(device=None, *, cache_dir: Optional[os.PathLike] = None, refresh: bool = False) -> HardwareReport:
    """Report (and on a GPU, measure or read from the cache) what ``device`` can do.

    ``device`` defaults to the current CUDA device when there is one, else the CPU. ``refresh=True``
    measures again and rewrites the cache. The cache folder defaults to :func:`default_cache_dir`.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        total, available = _host_memory()
        return HardwareReport(
            device=str(device), name=cpu_name(), total_memory=total, free_memory=available,
            cpu_cores=os.cpu_count(), notes=["no CUDA device: bandwidth, rank and PCIe checks are skipped"],
        )

    free, total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device)
    report = HardwareReport(
        device=str(device), name=props.name, total_memory=total, free_memory=free,
        compute_capability=f"{props.major}.{props.minor}",
    )
    key, key_fields = _cache_key(device)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"{key}.json"
    report.cache_file = str(path)
    cached = None
    if path.exists() and not refresh:
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") != key_fields:
                cached = None
        except (OSError, ValueError):
            cached = None  # a damaged cache file is measured again and rewritten
    if cached is not None:
        measured = cached["measured"]
        report.from_cache = True
    else:
        measured = _measure_cuda(device, free)
        measured["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key_fields, "measured": measured}, indent=2))
            os.replace(tmp, path)  # never leave a half-written cache behind
        except OSError as error:
            report.notes.append(f"could not write the hardware cache {path}: {error}")
    for name in _MEASURED_FIELDS:
        if name in measured:
            value = measured[name]
            setattr(report, name, list(value) + report.notes if name == "notes" else value)
    return report
