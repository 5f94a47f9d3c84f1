"""One entry for the benchmarks: ``python -m bench SUITE [SCRIPT] [ARGS...]`` from the repository root.

    python -m bench                          # the suites and their scripts, one line each
    python -m bench gate --shapes 1b ...     # a suite's first script (here regress.py) with these arguments
    python -m bench memory memory_plan ...   # another script of the suite
    python -m bench run gate OUT -- ...      # a device call: a suite's GPU tests, then its scripts (gpu_run.py)
    python -m bench tools archive FOLDER     # a raw results folder back from git history (archive.py)

Each script still runs on its own (``python bench/regress.py ...``); this entry finds it by what it measures.
"""

from __future__ import annotations

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from suites import LIBRARIES, SUITES, summary  # noqa: E402,F401  (LIBRARIES: for the tests)


def listing() -> str:
    lines = ["python -m bench SUITE [SCRIPT] [ARGS...]; a suite without SCRIPT runs its first one",
             "python -m bench run [RUN OUT ...]: one device call (python -m bench run lists them)", ""]
    for suite, scripts in SUITES.items():
        lines.append(suite)
        lines += [f"  {script:<26} {summary(script)}" for script in scripts]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    suite, rest = argv[0], argv[1:]
    if suite == "run":
        import gpu_run

        return gpu_run.main(rest)
    if suite not in SUITES:
        print(f"python -m bench: unknown suite {suite!r}; the suites: {', '.join(SUITES)} (python -m bench lists "
              "their scripts)", file=sys.stderr)
        return 2
    script = SUITES[suite][0]
    if rest and not rest[0].startswith("-"):
        if rest[0] not in SUITES[suite]:
            print(f"python -m bench {suite}: no script {rest[0]!r} in this suite; its scripts: "
                  f"{', '.join(SUITES[suite])}", file=sys.stderr)
            return 2
        script, rest = rest[0], rest[1:]
    path = os.path.join(HERE, script + ".py")
    sys.argv = [path, *rest]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
