#!/usr/bin/env bash
# Issue 5 (per-token dynamic rank) on one H200, one phase per GPU call (each call is limited to 10 minutes):
#
#     bash bench/run_dynamic_rank_gpu.sh OUT MODEL PHASE
#
# MODEL: the SmolLM2-135M-Instruct GGUF (or any spec sits_lora.recipe.loading takes). PHASE:
#   trace   the budget rule at the evaluation's batch: price with η 2 (the H200 evaluation of session 4 sat
#           at 17.3 for a target of 16) against η 6 (the default since), entropy-gated and learned
#           (4 runs of 80 steps; ~45 s each measured in session 3, plus the model load and entropy pass)
#   static  the evaluation's static arms at the rates their grid picked in session 2 (static r16 and r64 1e-3,
#           inside the grid 5e-4..2e-3), nested r64 and learned tuned on 2e-3 and 4e-3 (2e-3 was the top of
#           their grid in session 2: the tuned rate may lie above it)
#   routed  entropy-gated and random (which takes entropy-gated's histogram, so both run in one call) tuned
#           on 2e-3 and 4e-3, price mode, the library's default step
#   layer   the per-token-rank layer against the static kernel, with the router's decision compiled and eager,
#           and each arm's GPU kernel time alone (gpu_ms; the narrow shapes' wall-clock ratios are host-noisy)
#           (MODEL unused; 138 s measured in session 5 before gpu_ms was added)
# Each phase writes OUT/PHASE/ and then packs it into OUT/PHASE.tgz (a call returns only a few files).
# Merge the two evaluation phases on any machine:
#   python bench/dynamic_rank_eval.py --budget --merge-partials DIR/routed/dynamic_rank_eval_partial.json \
#       DIR/static/dynamic_rank_eval_partial.json --out DIR/eval
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 3 ]; then
    echo "usage: bash bench/run_dynamic_rank_gpu.sh OUT MODEL trace|static|routed|layer" >&2
    exit 2
fi
OUT="$1"; MODEL="$2"; PHASE="$3"
case "$PHASE" in trace|static|routed|layer) ;; *) echo "PHASE must be trace, static, routed or layer, not '$PHASE'" >&2; exit 2 ;; esac
mkdir -p "$OUT/$PHASE"
status=0
case "$PHASE" in
    trace)
        for arm in entropy-gated learned; do
            python bench/rank_budget_trace.py --size budget --steps 80 --model "$MODEL" --arm "$arm" \
                --rules price:2 price:6 --out "$OUT/trace/$arm" || status=1
        done ;;
    static)
        python bench/dynamic_rank_eval.py --budget --model "$MODEL" --arms static-r16,static-r64,nested-r64,learned \
            --lr static-r16=1e-3,static-r64=1e-3 --lr-grid 2e-3,4e-3 --rank-budget-mode price \
            --out "$OUT/static" || status=1 ;;
    routed)
        python bench/dynamic_rank_eval.py --budget --model "$MODEL" --arms entropy-gated,random \
            --lr-grid 2e-3,4e-3 --rank-budget-mode price --out "$OUT/routed" || status=1 ;;
    layer)
        python bench/bench_dynamic_rank_layer.py --out "$OUT/layer" || status=1 ;;
esac
tar czf "$OUT/$PHASE.tgz" -C "$OUT" "$PHASE" && rm -rf "${OUT:?}/$PHASE"
exit $status
