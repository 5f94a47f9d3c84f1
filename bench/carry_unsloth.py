"""Wheels that put Unsloth on the GPU machine, which has no internet: downloaded here, trimmed to fit one device call.

    python bench/carry_unsloth.py                 # writes .whl_unsloth/ (ignored by git), prints its size
    python bench/carry_unsloth.py --dest DIR --check-only   # the sizes of wheels already there

Then, on the GPU (the device tool, carry [".whl_unsloth"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_unsloth/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
    python3 bench/regress.py --out $OUT --shapes 1b --no-graph-breaks --arms frozen+liger sits+liger sits+default \
        unsloth unsloth+gc

What the GPU image lacks for unsloth 2026.10.9 (its requirements, read from the wheels' metadata, less what the
image has: torch, triton, transformers 5.17, peft, accelerate, huggingface_hub, sentencepiece, protobuf, pyarrow,
xxhash, pandas, rich, typer, psutil, regex, requests, pillow, einops) is pinned in WHEELS, with liger-kernel for
the floor arms. Two wheels are trimmed, the reason the whole set fits beside the source tree in one call's 64 MiB:
Unsloth's (its ``studio/`` web application, 26 of its 28.6 MB, is not imported by ``unsloth``) and bitsandbytes'
(one native library per CUDA and ROCm version; the image's CUDA 13 keeps ``libbitsandbytes_cuda13*``). xformers is
left out: Unsloth falls back to PyTorch's attention without it. datasets is the 4.x line (Unsloth and trl refuse
5.x), so this set does not go together with ``.whl/`` (datasets 5.2 for the recipe).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WHEELS = [
    "unsloth==2026.10.9", "unsloth_zoo==2026.10.9", "torchao==0.18.0", "cut_cross_entropy==25.1.1",
    "trl==1.15.0", "datasets==4.8.5", "dill==0.4.1", "multiprocess==0.70.19", "tyro==1.0.17",
    "docstring-parser==0.18.0", "typeguard==4.6.1", "shtab==1.13.0", "msgspec==0.23.0", "hf_transfer==0.1.9",
    "json5==0.17.3", "structlog==26.1.0", "nest-asyncio==1.6.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "bitsandbytes==0.50.2", "liger-kernel==0.8.5",
]
# the GPU machine: Python 3.12 on x86-64 Linux
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi",
            "abi3", "--abi", "none"] + [arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                                        "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                                                        "manylinux2014_x86_64", "any")
                                        for arg in ("--platform", tag)]
# (wheel name prefix, keep a member?) for the trimmed wheels
TRIMS = {
    "unsloth-": lambda name: not name.startswith("studio/"),
    "bitsandbytes-": lambda name: not (name.startswith("bitsandbytes/libbitsandbytes_")
                                       and not name.startswith("bitsandbytes/libbitsandbytes_cuda13")
                                       and not name.startswith("bitsandbytes/libbitsandbytes_cpu")),
}
CARRY_LIMIT = 64 * 2**20


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(path: str, keep) -> int:
    """Rewrite the wheel at ``path`` with only the members ``keep`` accepts (its RECORD to match); bytes saved."""
    before = os.path.getsize(path)
    tmp = path + ".trimmed"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        members = [m for m in src.infolist() if keep(m.filename)]
        record = next((m for m in members if m.filename.endswith(".dist-info/RECORD")), None)
        lines = []
        for member in members:
            if member is record:
                continue
            data = src.read(member)
            dst.writestr(member, data)
            lines.append(_record_line(member.filename, data))
        if record is not None:
            lines.append(f"{record.filename},,")
            dst.writestr(record, "\n".join(lines) + "\n")
    os.replace(tmp, path)
    return before - os.path.getsize(path)


def tree_bytes() -> int:
    """What the device call sends besides the carried folder: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum(os.path.getsize(os.path.join(ROOT, n.decode())) for n in names
               if n and os.path.isfile(os.path.join(ROOT, n.decode())))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default=os.path.join(ROOT, ".whl_unsloth"))
    parser.add_argument("--check-only", action="store_true", help="no download: report the sizes of --dest")
    args = parser.parse_args(argv)
    os.makedirs(args.dest, exist_ok=True)
    if not args.check_only:
        for i, spec in enumerate(WHEELS, 1):
            print(f"[{i}/{len(WHEELS)}] {spec}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", args.dest,
                            spec], check=True)
        for name in sorted(os.listdir(args.dest)):
            keep = next((rule for prefix, rule in TRIMS.items() if name.startswith(prefix)), None)
            if keep is not None:
                saved = trim(os.path.join(args.dest, name), keep)
                print(f"trimmed {name}: {saved / 2**20:.1f} MiB less", flush=True)
    wheels = sorted(n for n in os.listdir(args.dest) if n.endswith(".whl"))
    carried = sum(os.path.getsize(os.path.join(args.dest, n)) for n in wheels)
    tree = tree_bytes()
    print(f"{len(wheels)} wheels, {carried / 2**20:.1f} MiB; the source tree {tree / 2**20:.1f} MiB; together "
          f"{(carried + tree) / 2**20:.1f} of the {CARRY_LIMIT / 2**20:.0f} MiB one device call carries")
    missing = [spec for spec in WHEELS
               if not any(n.lower().startswith(spec.split("==")[0].replace("-", "_").lower() + "-") for n in wheels)]
    if missing:
        print("missing: " + ", ".join(missing))
    return 1 if missing or carried + tree > CARRY_LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
