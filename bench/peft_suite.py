"""PEFT's own test suite, run against sits_lora: does SitsLoraConfig pass where LoraConfig passes?

    python bench/peft_suite.py --out OUT                 # test_custom_models.py -k LoRA: ~4 min a mode, 2 CPU cores
    python bench/peft_suite.py --out OUT --files test_custom_models.py test_other.py test_config.py -k ""

The tests are those of the installed PEFT version, from its source distribution on PyPI (downloaded
into OUT/src; ``--peft-src DIR`` uses an unpacked one instead). They run three times, each in its own
pytest process:

    plain   as PEFT ships them, sits_lora not imported: what fails on this machine anyway
            (tests that need the Hugging Face hub fail at once: the harness refuses hub calls)
    import  sits_lora imported first (it adds SITS_LORA to PEFT's registries): importing sits_lora
            must not change what PEFT's tests see
    swap    ``peft.LoraConfig`` is ``SitsLoraConfig`` before the test modules import it, so every
            LoRA case of the suite builds sits_lora's layers and tuner

A test that passes under ``plain`` and fails under ``import`` or ``swap`` is a difference. ``--plain failures`` runs
plain last and only on the tests that failed under the others (the only plain outcomes a difference depends on). Those
the project knows and keeps on purpose are listed in KNOWN_DIFFERENCES, each with its reason; any other
makes the script exit 1. Writes OUT/peft_suite.json (versions, each mode's command and counts, every
difference with the first line of its error), OUT/peft_suite.csv (one row per test and mode) and
OUT/peft_suite.png; each mode's pytest output is in OUT/<mode>.log.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = ("plain", "import", "swap")

# test id (regular expression, searched; ids read "tests.test_file.TestClass::test_name[params]") -> why it differs,
# kept on purpose
KNOWN_DIFFERENCES = {
    r"TestLayerRepr::test_repr_lora_linear$|TestModelAndLayerStatus::test_(module_type|target_parameters_and_target)":
        "the layer's name: sits_lora's layer prints (repr, get_layer_status().module_type) as "
        "'sits_lora.SitsLoraLinear', not 'lora.Linear', so a printed model shows which layers run the fused path",
    r"TestModelAndLayerStatus::test_(peft_types|adapter_model_type|model_status_with|model_target_parameters)":
        "the adapter's type: get_model_status reports peft type SITS_LORA and tuner SitsLoraModel, as "
        "adapter_config.json says",
    r"TestHotSwapping::test_hotswap_(different|wrong)_peft_types_raises$":
        "PEFT's errors name the types: 'Incompatible PEFT types found: SITS_LORA and IA3'; 'Hotswapping only "
        "supports LORA, SITS_LORA but IA3 was passed' once a sits_lora adapter exists (it registers for hotswap)",
    r"::test_modules_to_save_targets_lora_layer_raises$":
        "PEFT's error names the layer's class: sits_lora.layers.linear.SitsLoraLinear, not peft's lora.layer.Linear",
    r"::test_lora_with_bias_argument\[invalid\]$":
        "SitsLoraConfig(bias='invalid') raises a ValueError naming the field and the allowed values when the config "
        "is made; LoraConfig accepts it and get_peft_model raises NotImplementedError",
    r"::test_safe_merge\[Conv\dd[^\]]*-AdaLoraConfig-":
        "the test's own tolerance: it allows 1e-3 on convolutions for subclasses of LoraConfig; with LoraConfig "
        "swapped, AdaLoraConfig (PEFT's, untouched) is no longer one and gets 1e-6",
}

PLUGINS = {
    # the machine has no hub: huggingface_hub would retry each call with back-off for tens of seconds
    "peft_suite_no_hub": (
        "import huggingface_hub.utils._http as _http\n\n\n"
        "def _refuse(*args, **kwargs):\n"
        "    raise OSError('peft_suite: no Hugging Face hub on this machine')\n\n\n"
        "for _name in ('http_backoff', '_http_backoff_base'):\n"
        "    if hasattr(_http, _name):\n"
        "        setattr(_http, _name, _refuse)\n"
    ),
    # PEFT writes a model card at every save_pretrained, and huggingface_hub compiles the same jinja2 template for
    # each (a fifth of the suite's time on a CPU): compiled once per template text here, every card still rendered;
    # only jinja2.Template's shared environments, which jinja2 keeps unchanged
    "peft_suite_card_template": (
        "import jinja2\n\n_compile = jinja2.Environment.compile\n_compiled = {}\n\n\n"
        "def _compile_once(self, source, name=None, filename=None, raw=False, defer_init=False):\n"
        "    if not getattr(self, 'shared', False) or not isinstance(source, str):\n"
        "        return _compile(self, source, name, filename, raw, defer_init)\n"
        "    key = (id(self), source, name, filename, raw, defer_init)\n"
        "    if key not in _compiled:  # the environment is kept with its code: its id is not reused\n"
        "        _compiled[key] = (self, _compile(self, source, name, filename, raw, defer_init))\n"
        "    return _compiled[key][1]\n\n\n"
        "jinja2.Environment.compile = _compile_once\n"
    ),
    "peft_suite_import": "import sits_lora  # noqa: F401\n",
    "peft_suite_swap": (
        "import peft\n\nimport sits_lora\n\n"
        "peft.LoraConfig = sits_lora.SitsLoraConfig\n"
    ),
}
MODE_PLUGINS = {"plain": ["peft_suite_no_hub", "peft_suite_card_template"],
                "import": ["peft_suite_no_hub", "peft_suite_card_template", "peft_suite_import"],
                "swap": ["peft_suite_no_hub", "peft_suite_card_template", "peft_suite_swap"]}


class SuiteError(Exception):
    """A bad argument or a missing piece, found before the slow part starts."""


def peft_source(out: str, given: str | None) -> str:
    """An unpacked PEFT source tree with tests/ for the installed version."""
    if given:
        if not os.path.isdir(os.path.join(given, "tests")):
            raise SuiteError(f"--peft-src {given}: no tests/ folder there; give an unpacked PEFT source "
                             f"distribution (pip download --no-deps --no-binary :all: peft==VERSION)")
        return os.path.abspath(given)
    version = metadata.version("peft")
    folder = os.path.join(out, "src")
    unpacked = os.path.join(folder, f"peft-{version}")
    if not os.path.isdir(unpacked):
        os.makedirs(folder, exist_ok=True)
        print(f"downloading PEFT {version}'s source distribution (its tests) from PyPI ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                               f"peft=={version}", "-d", folder], capture_output=True, text=True)
        archives = glob.glob(os.path.join(folder, f"peft-{version}.tar.gz"))
        if done.returncode != 0 or not archives:
            raise SuiteError(f"could not download peft=={version}'s source distribution "
                             f"({done.stderr.strip().splitlines()[-1:] or 'no archive'}); download and unpack it "
                             f"by hand and pass --peft-src")
        with tarfile.open(archives[0]) as archive:
            archive.extractall(folder, filter="data")
    if not os.path.isdir(os.path.join(unpacked, "tests")):
        raise SuiteError(f"{unpacked} has no tests/ folder: this PEFT release does not ship its tests; pass "
                         f"--peft-src with a checkout of the matching tag")
    # the tests import each other as a package (from .testing_common import ...); the archive leaves out __init__
    open(os.path.join(unpacked, "tests", "__init__.py"), "a").close()
    return unpacked


def write_plugins(out: str) -> str:
    folder = os.path.join(out, "plugins")
    os.makedirs(folder, exist_ok=True)
    for name, text in PLUGINS.items():
        with open(os.path.join(folder, f"{name}.py"), "w") as f:
            f.write(text)
    return folder


def pytest_command(mode: str, files: list[str], keyword: str, junit: str | None,
                   node_ids: list[str] | None = None) -> list[str]:
    """The pytest command of one mode: the files with the keyword, or only the tests ``node_ids`` names."""
    targets = node_ids if node_ids is not None else [os.path.join("tests", f) for f in files]
    command = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-W",
               "ignore::DeprecationWarning"]
    for plugin in MODE_PLUGINS[mode]:
        command += ["-p", plugin]
    if keyword and node_ids is None:
        command += ["-k", keyword]
    if junit:
        command += ["--junitxml", junit]
    return command


def environment_for(plugins: str) -> dict:
    paths = [plugins, os.path.join(REPO, "src"), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "HF_HUB_OFFLINE": "1"}


def check_collection(source: str, files: list[str], keyword: str, env: dict) -> int:
    """Collect once (no test runs): missing test dependencies and bad file names stop here, named."""
    for name in files:
        if not os.path.isfile(os.path.join(source, "tests", name)):
            raise SuiteError(f"--files {name}: not in {os.path.join(source, 'tests')}")
    done = subprocess.run(pytest_command("plain", files, keyword, None) + ["--collect-only"], cwd=source, env=env,
                          capture_output=True, text=True)
    missing = sorted(set(re.findall(r"No module named '([\w.]+)'", done.stdout + done.stderr)))
    if missing:
        raise SuiteError(f"PEFT's tests import {', '.join(missing)}, not installed here: pip install "
                         f"{' '.join(m.split('.')[0] for m in missing)}")
    counted = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
    if done.returncode not in (0, 5) or not counted:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SuiteError(f"collecting PEFT's tests failed (exit {done.returncode}):\n{tail}")
    return int(counted.group(1))


def read_junit(path: str) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, first line of the message)} from pytest's JUnit XML."""
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        test_id = f"{module}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                if outcome != "skipped":
                    break
        outcomes[test_id] = (outcome, message)
    return outcomes


def run_mode(mode: str, source: str, files: list[str], keyword: str, env: dict, out: str,
             node_ids: list[str] | None = None) -> dict:
    junit = os.path.join(out, f"junit_{mode}.xml")
    command = pytest_command(mode, files, keyword, junit, node_ids)
    started = time.perf_counter()
    with open(os.path.join(out, f"{mode}.log"), "w") as log:
        process = subprocess.Popen(command, cwd=source, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        for line in process.stdout:  # pytest's own progress, shown and kept
            log.write(line)
            if re.match(r"^[.sFExX]+\s+\[\s*\d+%\]", line):
                print(f"  {mode:6} {line.rstrip()}", flush=True)
        code = process.wait()
    if not os.path.exists(junit):
        raise SuiteError(f"pytest ({mode}) exited {code} without results; see {os.path.join(out, mode + '.log')}")
    return {"command": " ".join(command[1:]), "exit_code": code, "seconds": round(time.perf_counter() - started, 1),
            "outcomes": read_junit(junit)}


def plain_id(test_id: str) -> str:
    """The id the same test has under plain PEFT: parametrized ids name the config class (SitsLoraConfig, or
    'SitsLora' in names made from it)."""
    return test_id.replace("SitsLora", "Lora")


def node_id(test_id: str, source: str) -> str:
    """pytest's node id of a JUnit test id ("tests.test_file.TestClass::test_name[params]" ->
    "tests/test_file.py::TestClass::test_name[params]"): the longest dotted prefix that is a file of the source."""
    dotted, name = test_id.split("::", 1)
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if os.path.isfile(os.path.join(source, path)):
            return "::".join([path, *parts[cut:], name])
    return "::".join(["/".join(parts) + ".py", name])


def failed_elsewhere(results: dict, source: str) -> list[str]:
    """Node ids, as plain PEFT names them, of the tests that failed under import or swap: the only plain outcomes
    a difference can depend on."""
    failed = {plain_id(test_id) for mode in ("import", "swap") if mode in results
              for test_id, (outcome, _) in results[mode]["outcomes"].items() if outcome in ("failed", "error")}
    return sorted(node_id(test_id, source) for test_id in failed)


def differences(results: dict) -> list[dict]:
    """Tests that pass (or skip) as PEFT ships them and fail with sits_lora imported or swapped in."""
    plain = {plain_id(test_id): outcome for test_id, outcome in results["plain"]["outcomes"].items()}
    found = []
    for mode in ("import", "swap"):
        if mode not in results:
            continue
        for test_id, (outcome, message) in sorted(results[mode]["outcomes"].items()):
            before = plain.get(plain_id(test_id), ("missing", ""))[0]
            if outcome in ("failed", "error") and before not in ("failed", "error"):
                known = next((why for pattern, why in KNOWN_DIFFERENCES.items() if re.search(pattern, test_id)), None)
                found.append({"mode": mode, "test": test_id, "plain": before, "outcome": outcome,
                              "message": message, "known": known})
    return found


def counts(outcomes: dict) -> dict:
    total = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome, _ in outcomes.values():
        total[outcome] += 1
    return total


def draw(path: str, summary: dict) -> None:
    sys.path.insert(0, HERE)
    from harness import png  # here, not at the top: it imports torch, and the refusals come before any of that

    modes = list(summary["modes"])
    colours = {"passed": "#4c9f70", "skipped": "#bbbbbb", "failed": "#d1495b", "error": "#edae49"}
    with png(path, figsize=(9, 1.2 + 0.7 * len(modes))) as ax:
        if ax is None:
            return
        labels = []
        for row, mode in enumerate(modes):
            tally = summary["modes"][mode]["counts"]
            total, left = sum(tally.values()), 0
            for outcome, colour in colours.items():
                ax.barh(row, tally[outcome], left=left, color=colour, label=outcome if row == 0 else None)
                if tally[outcome] > 0.06 * total:  # a number only where it fits; every count is in the row's label
                    ax.text(left + tally[outcome] / 2, row, str(tally[outcome]), ha="center", va="center", fontsize=8)
                left += tally[outcome]
            name = "plain (those failing elsewhere)" if mode == "plain" and summary.get("plain") == "failures" else mode
            labels.append(f"{name}\n" + ", ".join(f"{tally[o]} {o}" for o in colours if tally[o]))
        ax.set_yticks(range(len(modes)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("tests")
        new = sum(1 for d in summary["differences"] if not d["known"])
        ax.set_title(f"PEFT {summary['environment']['peft']}'s tests ({', '.join(summary['files'])}"
                     f"{', -k ' + repr(summary['keyword']) if summary['keyword'] else ''}): "
                     f"{len(summary['differences'])} differences from plain, {new} unexplained", fontsize=9,
                     wrap=True)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(modes) > 2 else -0.5), ncol=4, fontsize=8,
                  frameon=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results (and PEFT's source, unless --peft-src)")
    parser.add_argument("--files", nargs="+", default=["test_custom_models.py"],
                        help="test files under PEFT's tests/ (default: test_custom_models.py)")
    parser.add_argument("-k", dest="keyword", default="LoRA", help="pytest -k expression (default: LoRA; '' for all)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="plain is always run: the others are compared with it")
    parser.add_argument("--plain", choices=("all", "failures"), default="all",
                        help="all: run every selected test as PEFT ships it (its counts are the baseline the plot "
                             "shows); failures: run plain last, only on the tests that failed under import or swap "
                             "(one full run fewer; the same differences)")
    parser.add_argument("--peft-src", help="an unpacked PEFT source tree with tests/ (default: download the sdist "
                                           "of the installed version)")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    others = [m for m in args.modes if m != "plain"]
    if args.plain == "failures" and not others:
        parser.error("--plain failures reruns what failed under import or swap: name one of them in --modes")
    modes = others + ["plain"] if args.plain == "failures" else ["plain"] + others
    try:
        if os.path.exists(out) and not os.path.isdir(out):
            raise SuiteError(f"--out {args.out}: a file of that name exists; give a folder")
        os.makedirs(out, exist_ok=True)
        source = peft_source(out, args.peft_src)
        env = environment_for(write_plugins(out))
        collected = check_collection(source, args.files, args.keyword, env)
        print(f"{collected} tests of PEFT {metadata.version('peft')} ({', '.join(args.files)}), modes: "
              f"{', '.join(modes)}", flush=True)
        results = {}
        for mode in modes:
            rerun = failed_elsewhere(results, source) if mode == "plain" and args.plain == "failures" else None
            if rerun == []:  # nothing failed: no plain outcome can matter
                results[mode] = {"command": "(nothing to run)", "exit_code": 0, "seconds": 0.0, "outcomes": {}}
                continue
            results[mode] = run_mode(mode, source, args.files, args.keyword, env, out, rerun)
            print(f"{mode:6} {counts(results[mode]['outcomes'])}  {results[mode]['seconds']:.0f} s", flush=True)
    except SuiteError as error:
        print(f"peft_suite: {error}", file=sys.stderr)
        return 2
    from sits_lora.utils.env import environment

    found = differences(results)
    summary = {"environment": environment(), "files": args.files, "keyword": args.keyword, "plain": args.plain,
               "peft_source": source,
               "modes": {m: {"command": r["command"], "exit_code": r["exit_code"], "seconds": r["seconds"],
                             "counts": counts(r["outcomes"])} for m, r in results.items()},
               "differences": found, "known_differences": KNOWN_DIFFERENCES}
    with open(os.path.join(out, "peft_suite.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out, "peft_suite.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["test", "mode", "outcome", "message"])
        for mode, result in results.items():
            for test_id, (outcome, message) in sorted(result["outcomes"].items()):
                writer.writerow([test_id, mode, outcome, message])
    draw(os.path.join(out, "peft_suite.png"), summary)
    unexplained = [d for d in found if not d["known"]]
    for d in found:
        print(f"{'known' if d['known'] else 'NEW':5} [{d['mode']}] {d['test']}: {d['message'][:160]}"
              + (f"\n      why: {d['known']}" if d["known"] else ""))
    print(f"{len(found)} differences from plain PEFT, {len(unexplained)} unexplained; results in {out}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
