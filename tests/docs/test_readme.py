"""The README's commands are the ones CI runs."""

from __future__ import annotations

import os
import re

from conftest import REPO_ROOT


def _readme_commands():
    text = open(os.path.join(REPO_ROOT, "README.md")).read()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    test_cmd = [c for c in commands if "pytest" in c]
    assert len(test_cmd) == 1
    ci = open(os.path.join(REPO_ROOT, ".ci", "run")).read()
    assert test_cmd[0].strip() in ci.splitlines()


def test_main_job_command_installs_torch_first_and_launches_the_recipe():
    main_cmd = [c for c in _readme_commands() if "recipes/train.py" in c]
    assert len(main_cmd) == 1
    assert main_cmd[0].startswith("pip install torch==") and main_cmd[0].endswith("accelerate launch --quiet recipes/train.py")
