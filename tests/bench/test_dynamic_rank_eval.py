"""The dynamic-rank evaluation (bench/dynamic_rank_harness.py): its settings, and the bench script end to end on a
tiny random model."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, bench_module

_harness = bench_module("dynamic_rank_harness")
ARMS, ByteTokenizer, EvalSettings = _harness.ARMS, _harness.ByteTokenizer, _harness.EvalSettings
pack_blocks, results_from_partials = _harness.pack_blocks, _harness.results_from_partials
settings_for, summarize = _harness.settings_for, _harness.summarize


@pytest.mark.slow
def test_bench_script_runs_every_arm_and_writes_json_csv_png(tmp_path):
    proc = subprocess.run(
        # every arm runs in the notebook test (notebooks/dynamic_rank.ipynb, tiny preset); here the command line
        [sys.executable, os.path.join(REPO_ROOT, "bench", "dynamic_rank_eval.py"), "--size", "tiny", "--steps", "2",
         "--arms", "nested-r64,entropy-gated,random", "--lr-grid", "3e-3,1e-3", "--lr", "full-ft=5e-4",
         "--out", str(tmp_path),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        # a copy of the tree without .git (the GPU machine's) names its revision so; the results must carry it
        env={**os.environ, "SITS_LORA_GIT_REVISION": "abc1234-test"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "dynamic_rank_eval.json").read_text())
    arms = {row["arm"] for row in results["rows"]}
    assert arms == {"full-ft", "entropy-gated", "random"} | {f"nested-r64@{k}" for k in (16, 32, 48, 64)}
    assert all(row["seeds"] == 2 for row in results["rows"])
    env = results["environment"]
    assert env["git_revision"] == "abc1234-test" and env["cpu"] and env["torch"] and env["transformers"] and env["peft"]
    routed = [r for r in results["runs"] if r["arm"] in ("entropy-gated", "random")]
    assert all(0 <= r["active_rank"] <= 64 and abs(sum(r["test_histogram"].values()) - 1) < 1e-9 for r in routed)
    assert all(r["kl_vs_full_ft"] >= 0 for r in results["runs"])
    assert {t["lr"] for t in results["tuning"] if t["arm"] == "random"} == {3e-3, 1e-3}  # --lr-grid reached the arms
    assert {t["lr"] for t in results["tuning"] + results["runs"] if t["arm"] == "full-ft"} == {5e-4}  # --lr: no grid
    counts = results["router"]["parameter_counts"]["entropy-gated"]
    assert counts["router"] > 0 and counts["entropy_probe"] > 0 and counts["layers"] == 7
    # entropy-gated runs at both rates of seed 0, then seed 1: every run after the first reads the entropy cache
    assert results["router"]["sampler_cache_hits"] == [False, True, True]
    with open(tmp_path / "dynamic_rank_eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(results["rows"]) and {r["git_revision"] for r in rows} == {"abc1234-test"}
    assert (tmp_path / "dynamic_rank_eval.png").stat().st_size > 10_000
    assert (tmp_path / "dynamic_rank_eval_runs.csv").exists()


def test_presets_and_bad_settings():
    budget = settings_for("budget")
    assert len(budget.seeds) >= 3 and budget.arms == ARMS and budget.steps * budget.batch_size * budget.seq_len == 327_680
    assert settings_for("tiny", steps=3).steps == 3
    with pytest.raises(ValueError, match="size='huge' is invalid: allowed values are 'tiny', 'smoke', 'budget'"):
        settings_for("huge")
    with pytest.raises(ValueError, match="EvalSettings.arms has unknown arms \\['moe'\\]"):
        EvalSettings(arms=("static-r16", "moe"))
    with pytest.raises(ValueError, match="lr_by_arm names an unknown arm 'static-r8'"):
        EvalSettings(lr_by_arm={"static-r8": 1e-3})
    with pytest.raises(ValueError, match="lr_by_arm\\['learned'\\]=0 is invalid: it must be a positive number"):
        EvalSettings(lr_by_arm={"learned": 0})
    assert settings_for("budget", lr_by_arm={"static-r16": 1e-3}).lr_by_arm == {"static-r16": 1e-3}
    # the budget's step size: the library's default for the mode, recorded as a number
    assert budget.rank_budget_mode == "price" and budget.rank_budget_step_size == 6.0
    assert settings_for("budget", rank_budget_mode="target").rank_budget_step_size == 0.5
    with pytest.raises(ValueError, match="EvalSettings.rank_budget_mode='cap' is invalid"):
        EvalSettings(rank_budget_mode="cap")
    with pytest.raises(ValueError, match="'random' uses the histogram of 'entropy-gated'"):
        EvalSettings(arms=("random",))
    with pytest.raises(ValueError, match="EvalSettings.steps=0 is invalid"):
        EvalSettings(steps=0)
    with pytest.raises(ValueError, match="mean_rank=24 must be one of nested_buckets"):
        EvalSettings(mean_rank=24)


def test_blocks_are_packed_like_the_data_module():
    from datasets import Dataset

    from sits_lora.recipe.data import pack_into_blocks

    texts = ["def f(x):\n    return x", "A longer paragraph of text, " * 5, "tail"]
    expected = pack_into_blocks(Dataset.from_dict({"text": texts}), ByteTokenizer(), 16, max_blocks=5)["input_ids"]
    assert pack_blocks(texts, ByteTokenizer(), 16, 5).tolist() == expected


def test_summary_is_mean_and_sample_std_over_seeds():
    runs = [{"arm": "a", "lr": 1e-3, "test_loss": v, "test_ppl": 1.0, "kl_vs_full_ft": 0.1, "active_rank": 16.0}
            for v in (1.0, 2.0, 3.0)]
    row = summarize(runs + [{"arm": "b", "lr": 1e-3, "test_loss": 5.0, "test_ppl": 1.0, "kl_vs_full_ft": None,
                             "active_rank": None}])
    assert row[0]["test_loss_mean"] == 2.0 and row[0]["test_loss_std"] == 1.0 and row[0]["seeds"] == 3
    assert row[1]["test_loss_std"] is None and row[1]["kl_vs_full_ft_mean"] is None  # one seed: no spread


def _partial(path, runs):
    path.write_text(json.dumps({"environment": {"git_revision": "abc1234"}, "model": "m", "runs": runs,
                                "tuning": [dict(r) for r in runs if r["seed"] == 0]}))
    return str(path)


def test_merged_partials_take_each_arm_and_seed_from_the_first_file_that_has_it(tmp_path):
    def run(arm, seed, lr, loss):
        return {"arm": arm, "seed": seed, "lr": lr, "test_loss": loss, "test_ppl": 1.0, "kl_vs_full_ft": 0.1,
                "active_rank": 16.0}

    # call A cut after learned seed 1; call B ran the missing seed 2 (and repeats full-ft, its KL reference)
    a = _partial(tmp_path / "a.json", [run("full-ft", s, 1e-4, 2.0 + s) for s in (0, 1, 2)]
                 + [run("learned", 0, 2e-3, 3.0), run("learned", 1, 2e-3, 3.2)])
    b = _partial(tmp_path / "b.json", [run("full-ft", 2, 1e-4, 9.0), run("learned", 1, 2e-3, 9.0),
                                       run("learned", 2, 2e-3, 3.4)])
    merged = results_from_partials([a, b], settings_for("tiny"))
    taken = sorted((r["arm"], r["seed"], r["test_loss"]) for r in merged["runs"])
    assert taken == [("full-ft", 0, 2.0), ("full-ft", 1, 3.0), ("full-ft", 2, 4.0),
                     ("learned", 0, 3.0), ("learned", 1, 3.2), ("learned", 2, 3.4)]
    rows = {r["arm"]: r for r in merged["rows"]}
    assert rows["learned"]["seeds"] == 3 and rows["learned"]["test_loss_mean"] == pytest.approx(3.2)
    assert merged["merged_from"] == [a, b] and merged["environment"]["git_revision"] == "abc1234"

    # one arm's seeds at two rates are not one arm: refused, naming the arm, both rates and the fix
    c = _partial(tmp_path / "c.json", [run("learned", 2, 4e-3, 3.4)])
    with pytest.raises(ValueError, match=r"arm 'learned' ran at lr 0.002 in .*a.json and at lr 0.004 in .*c.json "
                                         r"\(seed 2\).*--lr learned=0.002"):
        results_from_partials([a, c], settings_for("tiny"))


def test_partial_results_are_written_after_every_run(tmp_path):
    """A run cut short by the GPU session's time limit still leaves the finished runs on disk."""
    run_evaluation = _harness.run_evaluation

    settings = settings_for("tiny", steps=1, seeds=(0,), arms=("static-r16",), progress=False)
    run_evaluation(settings, out_dir=str(tmp_path))
    partial = json.loads((tmp_path / "dynamic_rank_eval_partial.json").read_text())
    assert [r["arm"] for r in partial["runs"]] == ["full-ft", "static-r16"]
    assert [r["arm"] for r in partial["tuning"]] == ["full-ft", "static-r16"]
    assert all(r["seed"] == 0 for r in partial["runs"]) and partial["seconds"] > 0


@pytest.mark.slow
def test_dynamic_rank_layer_bench_smoke(tmp_path):
    """bench/bench_dynamic_rank_layer.py end to end on the CPU (Triton interpreter), every arm present."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "bench", "bench_dynamic_rank_layer.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "dynamic_rank_layer_smoke.json").read_text())["rows"]
    arms = {r["arm"] for r in rows}
    assert {"frozen", "static-r64", "dyn:mixed:router", "dyn:mixed:hard-ungrouped", "layer:learned",
            "layer:learned-compiled-router"} <= arms
    assert "SITS_LORA_COMPILE_ROUTER" not in os.environ  # the compiled-router arm restores the environment
    assert all(r["full_ms"] > 0 and r["vs_static_r64"] > 0 and r["rounds"] == 3 and r["spread"] >= 0 for r in rows)
    assert all(r["gpu_ms"] is None and r["gpu_vs_static_r64"] is None for r in rows)  # kernel time: GPU only


def test_dynamic_rank_layer_bench_shapes_option(capsys):
    bench_dynamic_rank_layer = bench_module("bench_dynamic_rank_layer")

    assert bench_dynamic_rank_layer._shapes("4096x4096, 2048X8192") == [(4096, 4096), (2048, 8192)]
    with pytest.raises(SystemExit) as exit_info:
        bench_dynamic_rank_layer.main(["--shapes", "4096x0", "--smoke"])
    assert exit_info.value.code == 2
    assert "--shapes: '4096x0' is not DINxDOUT with two positive integers" in capsys.readouterr().err


@pytest.mark.slow
def test_fp8_quality_script_on_a_tiny_model(tmp_path):
    """bench/fp8_quality.py end to end with emulated fp8: both arms per seed, the summary and the 1 % verdict."""
    fp8_quality = bench_module("fp8_quality")

    result = fp8_quality.run(settings_for("tiny", steps=2), lr=1e-3, r=4, out_dir=str(tmp_path), command="test")
    assert [(r["arm"], r["seed"]) for r in result["rows"]] == [(a, s) for s in (0, 1) for a in fp8_quality.ARMS]
    fp8_rows = [r for r in result["rows"] if r["arm"] != "sits-bf16"]
    assert len(fp8_rows) == 4 and all(r["ratio"] <= 0.55 for r in fp8_rows)  # frozen-weight bytes vs bf16
    saved = json.loads((tmp_path / "fp8_quality.json").read_text())
    means = {s["arm"]: s["test_loss_mean"] for s in saved["summary"]}
    for arm in ("sits-fp8-hybrid", "sits-fp8-hybrid-row"):
        gap = saved["verdict"][arm]["relative_loss_gap"]
        assert gap == pytest.approx((means[arm] - means["sits-bf16"]) / means["sits-bf16"])

    # a run cut by a GPU call's limit: its partial file plus another call's log merge into one result
    partial = tmp_path / "fp8_quality_partial.json"
    assert len(json.loads(partial.read_text())["rows"]) == 6
    log = tmp_path / "other_call.log"
    log.write_text("model: ...\n       sits-bf16 seed 7: test loss 5.1234, 12.0 ms/step\n"
                   " sits-fp8-hybrid seed 7: test loss 5.2000, 13.5 ms/step\nrc 124\n")
    merged_dir = tmp_path / "merged"
    assert fp8_quality.main(["--size", "tiny", "--merge-runs", str(partial), str(log), "--out", str(merged_dir)]) == 0
    merged = json.loads((merged_dir / "fp8_quality.json").read_text())
    per_run = [r for r in merged["rows"] if "seed" in r]
    assert [(r["arm"], r["seed"]) for r in per_run if r["seed"] == 7] == [("sits-bf16", 7), ("sits-fp8-hybrid", 7)]
    seeds = {s["arm"]: s["seeds"] for s in merged["summary"]}
    assert seeds == {"sits-bf16": 3, "sits-fp8-hybrid": 3, "sits-fp8-hybrid-row": 2}
    bf16 = [r["test_loss"] for r in per_run if r["arm"] == "sits-bf16"]
    assert 5.1234 in bf16 and {s["arm"]: s["test_loss_mean"] for s in merged["summary"]}["sits-bf16"] == \
        pytest.approx(sum(bf16) / 3)


@pytest.mark.slow
def test_rank_budget_trace_script_compares_rules_step_by_step(tmp_path):
    rank_budget_trace = bench_module("rank_budget_trace")

    result = rank_budget_trace.run(settings_for("tiny", steps=4, seeds=(0,), cache_dir=str(tmp_path / "cache")),
                                   "learned", [("target", 0.5), ("price", 2.0)], lr=3e-3, seed=0,
                                   out_dir=str(tmp_path), command="test")
    assert [(r["mode"], r["step_size"]) for r in result["runs"]] == [("target", 0.5), ("price", 2.0)]
    for r in result["runs"]:
        assert len(r["trace_rank"]) == 4 and len(r["trace_lambda"]) == 4
        assert all(0 <= v <= 64 for v in r["trace_rank"]) and r["test_active_rank"] is not None
    saved = json.loads((tmp_path / "rank_budget_trace.json").read_text())
    assert len(saved["runs_with_traces"]) == 2 and (tmp_path / "rank_budget_trace.png").stat().st_size > 5_000
    with pytest.raises(SystemExit):
        rank_budget_trace.main(["--rules", "sideways:1"])


def test_router_learning_rate_scale_reaches_the_routers_only():
    """EvalSettings.router_lr_scale (rank_budget_trace.py --router-lr-scale): 0 freezes the routers in training while
    the adapter still learns."""
    import torch
    from peft import get_peft_model

    arm_config, load_blocks, load_eval_model, train_model = (
        _harness.arm_config, _harness.load_blocks, _harness.load_eval_model, _harness.train_model)

    settings = settings_for("tiny", steps=2, router_lr_scale=0.0)
    base, tokenizer, _ = load_eval_model(settings.model, settings.seq_len)
    train_blocks, _, _ = load_blocks(tokenizer, settings)
    model = get_peft_model(base, arm_config("learned", settings))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    train_model(model, train_blocks, settings, lr=1e-2, seed=0)
    changed = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert changed and not any("lora_router" in n for n in changed)
    assert any("lora_A" in n for n in changed)
