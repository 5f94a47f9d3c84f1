"""Bring a raw results folder back from git history: ``python -m bench tools archive FOLDER [OUT]``.

    python -m bench tools archive                      # the archived folders, one a line
    python -m bench tools archive 2026-12-06-session35  # into bench/results/2026-12-06-session35 (git-ignored)
    python -m bench tools archive 2026-12-06-session35 /tmp/s35

The raw run folders (logs, CSV, JSON, plots, the call scripts) are not in the tree: the figures that docs cite are rows
of docs/measurements.jsonl, each naming its folder. The folders stay in the history, whole, at ARCHIVE_REV; this
copies one out of it with ``git archive``, so it needs a git clone that holds that commit (not a shallow one).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)

# The last commit whose tree holds bench/results/: every archived folder is read from it.
ARCHIVE_REV = "0ea762cbdebb05fd95ee5b40705dc37d7ff72714"
ARCHIVED_DIR = "bench/results"


class ArchiveError(Exception):
    """A request this tool refuses, with the one line that says why."""


def _git(*args: str, binary: bool = False):
    try:
        proc = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=not binary)
    except FileNotFoundError:
        raise ArchiveError("git is not installed: the archived results live in the repository's git history")
    return proc.returncode, proc.stdout, proc.stderr


def check_clone() -> None:
    """Refuse outside a git clone, and in a clone without ARCHIVE_REV (a shallow one)."""
    code, _, _ = _git("rev-parse", "--git-dir")
    if code != 0:
        raise ArchiveError(f"{REPO_ROOT} is not a git clone: the archived results live in its history at "
                           f"{ARCHIVE_REV[:12]}; clone the repository with git to read them")
    code, _, _ = _git("cat-file", "-e", f"{ARCHIVE_REV}^{{commit}}")
    if code != 0:
        raise ArchiveError(f"this clone lacks commit {ARCHIVE_REV[:12]}, which holds the archived results "
                           "(a shallow clone?): run `git fetch --unshallow` or clone without --depth")


def archived_names() -> list:
    """The folders (and the few loose files) under bench/results/ at ARCHIVE_REV."""
    code, out, err = _git("ls-tree", "--name-only", ARCHIVE_REV, f"{ARCHIVED_DIR}/")
    if code != 0:
        raise ArchiveError(f"git ls-tree {ARCHIVE_REV[:12]} {ARCHIVED_DIR}/ failed: {err.strip()}")
    return [line.rsplit("/", 1)[-1] for line in out.splitlines() if line]


def extract(name: str, out: str) -> list:
    """Write bench/results/NAME of ARCHIVE_REV under OUT (a folder's files) or to OUT (a loose file); the paths
    written, relative to OUT."""
    names = archived_names()
    name = name.strip("/")
    if name not in names:
        raise ArchiveError(f"no archived results folder {name!r} at {ARCHIVE_REV[:12]}; the folders:\n  "
                           + "\n  ".join(names))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ArchiveError(f"{out} exists (a file, or a folder that is not empty): remove it or give another OUT")
    code, data, err = _git("archive", "--format=tar", ARCHIVE_REV, "--", f"{ARCHIVED_DIR}/{name}", binary=True)
    if code != 0:
        raise ArchiveError(f"git archive {ARCHIVE_REV[:12]} {ARCHIVED_DIR}/{name} failed: "
                           f"{err.decode(errors='replace').strip()}")
    prefix = f"{ARCHIVED_DIR}/{name}"
    written = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue  # folders are made as their files need them; git archive holds no links here
            relative = os.path.relpath(member.name, prefix)
            target = out if relative == "." else os.path.join(out, relative)
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                dst.write(src.read())
            os.chmod(target, member.mode & 0o777 or 0o644)
            written.append("." if relative == "." else relative)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench tools archive",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", help="a folder under bench/results/ at the archive revision; "
                                                  "none: list them")
    parser.add_argument("out", nargs="?", help="where to write it (default bench/results/FOLDER, git-ignored)")
    args = parser.parse_args(argv)
    try:
        check_clone()
        if args.folder is None:
            print("\n".join(archived_names()))
            return 0
        out = args.out or os.path.join(REPO_ROOT, ARCHIVED_DIR, args.folder.strip("/"))
        written = extract(args.folder, out)
    except ArchiveError as refusal:
        print(f"python -m bench tools archive: {refusal}", file=sys.stderr)
        return 2
    print(f"{len(written)} files of {ARCHIVED_DIR}/{args.folder.strip('/')} at {ARCHIVE_REV[:12]} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
