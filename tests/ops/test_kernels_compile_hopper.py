"""Every Triton kernel variant compiles for an H100 / H200 (sm_90), here on the CPU.

The interpreter (test_kernels.py and friends) checks what a kernel computes, but it runs the kernel
as Python: code that the GPU compiler rejects (a runtime branch it cannot lower, a dtype a dot does
not take) passes it. Triton compiles ahead of time for a named target without a GPU (its wheel
ships ptxas), so each launch variant the GPU runs is compiled to a cubin here, as in CI. The
compiles run in one subprocess: under the interpreter (on in the test process, see conftest) the
kernels are Python functions that cannot be compiled.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def compile_for_hopper(kernel, pointers: dict, constexprs: dict, options: dict):
    """The compiled kernel for sm_90: pointer element types by name, every other argument an int32 except
    ``scale`` (fp32)."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"constexprs not given: {missing}"
    source = triton.compiler.ASTSource(fn=kernel, signature=signature,
                                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


LORA = {"x": "*bf16", "h": "*fp32", "h_full": "*fp32", "a": "*fp32", "b": "*fp32", "bias": "*bf16", "c": "*bf16",
        "limit": "*i32", "order": "*i32", "dy": "*bf16", "g": "*fp32", "g_part": "*fp32", "db_part": "*fp32",
        "da_part": "*fp32", "dx": "*bf16", "g_out": "*fp32", "ends": "*i64", "dw": "*fp32", "up": "*bf16"}
POINTERS = {f"{k}_ptr": v for k, v in LORA.items()}

VARIANTS = [
    # kernel, config-space name (None: launched with fixed blocks, 4 warps), constexprs
    ("_lora_shrink_kernel", "shrink", dict(HAS_LIMIT=False, WRITE_FULL=False, BLOCK_R=64, DOT_PRECISION="tf32")),
    ("_lora_shrink_kernel", "shrink", dict(HAS_LIMIT=True, WRITE_FULL=False, BLOCK_R=64, DOT_PRECISION="tf32")),
    ("_lora_shrink_kernel", "shrink", dict(HAS_LIMIT=True, WRITE_FULL=True, BLOCK_R=64, DOT_PRECISION="tf32")),
    ("_lora_expand_kernel", "expand", dict(HAS_BIAS=True, ACCUMULATE=False, HAS_LIMIT=False, GROUPED=False,
                                           BLOCK_R=16, DOT_PRECISION="tf32")),
    ("_lora_expand_kernel", "expand", dict(HAS_BIAS=False, ACCUMULATE=True, HAS_LIMIT=False, GROUPED=False,
                                           BLOCK_R=16, DOT_PRECISION="tf32")),
    ("_lora_expand_kernel", "expand", dict(HAS_BIAS=False, ACCUMULATE=False, HAS_LIMIT=True, GROUPED=False,
                                           BLOCK_R=64, DOT_PRECISION="tf32")),
    ("_lora_expand_kernel", "expand", dict(HAS_BIAS=True, ACCUMULATE=False, HAS_LIMIT=True, GROUPED=True,
                                           BLOCK_R=64, DOT_PRECISION="tf32")),
    ("_lora_dy_pass_kernel", "dy_pass", dict(BLOCK_R=16, DOT_PRECISION="tf32")),
    ("_lora_dy_pass_kernel", "dy_pass", dict(BLOCK_R=64, DOT_PRECISION="tf32")),
    ("_lora_x_pass_kernel", "x_pass", dict(WRITE_DX=True, X_FORM=0, BLOCK_R=16, DOT_PRECISION="tf32")),
    ("_lora_x_pass_kernel", "x_pass", dict(WRITE_DX=False, X_FORM=0, BLOCK_R=64, DOT_PRECISION="tf32")),
    ("_lora_x_pass_kernel", "x_pass", dict(WRITE_DX=True, X_FORM=1, BLOCK_R=16, DOT_PRECISION="tf32")),
    ("_lora_x_pass_kernel", "x_pass", dict(WRITE_DX=True, X_FORM=2, BLOCK_R=16, DOT_PRECISION="tf32")),
    ("_limit_grad_kernel", None, dict(BUCKET_GRAD=False, BLOCK_T=64, BLOCK_R=64)),
    ("_limit_grad_kernel", None, dict(BUCKET_GRAD=True, BLOCK_T=64, BLOCK_R=64)),
]


FP8_VARIANTS = [("*fp8e4nv", 448.0), ("*fp8e5", 57344.0)]


def _variant_ids() -> list[str]:
    lora = [f"{v[0].strip('_')}-" + "-".join(f"{k}={x}" for k, x in v[2].items()
                                            if k.startswith(("HAS", "ACC", "GROUP", "WRITE", "BUCKET", "X_FORM"))) for v in VARIANTS]
    return (lora + [f"fp8_cast-{t.strip('*')}" for t, _ in FP8_VARIANTS] + ["transpose_bytes"]
            + ["fp8_matmul-forward-e4m3", "fp8_matmul-dX-e5m2"])


def compile_all() -> dict:
    """{variant id: "ok" or the error}: run in a process without TRITON_INTERPRET."""
    from sits_lora.ops import fp8_cast as fp8_ops
    from sits_lora.ops import fused, fused_backward, tuning

    jobs = []
    for kernel, space, constexprs in VARIANTS:
        config = tuning.CONFIG_SPACE[space][0] if space is not None else {"num_warps": 4}
        blocks = {k: v for k, v in config.items() if k.startswith("BLOCK")}
        options = {k: v for k, v in config.items() if not k.startswith("BLOCK")}
        jobs.append((getattr(fused, kernel, None) or getattr(fused_backward, kernel), POINTERS, {**constexprs, **blocks}, options))
    for out_type, fp8_max in FP8_VARIANTS:
        pointers = {"x_ptr": "*bf16", "out_ptr": out_type, "scale_ptr": "*fp32", "amax_ptr": "*fp32",
                    "colscale_ptr": "*fp32"}
        constexprs = dict(FP8_MAX=fp8_max, HAS_COLSCALE=True, WRITE_OUT=True, RECORD_AMAX=True, BLOCK_T=32, BLOCK_C=128)
        jobs.append((fp8_ops._fp8_cast_kernel, pointers, constexprs, {"num_warps": 4}))
    jobs.append((fp8_ops._transpose_bytes_kernel, {"src_ptr": "*u8", "dst_ptr": "*u8"},
                 dict(BLOCK_R=128, BLOCK_C=128), {"num_warps": 8}))
    for a_type in ("*fp8e4nv", "*fp8e5"):   # forward: x8 e4m3 × W8ᵀ; dX: dy8 e5m2 × W8 (the strides differ at run time)
        pointers = {"a_ptr": a_type, "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "l_ptr": "*fp32", "r_ptr": "*fp32",
                    "bias_ptr": "*bf16", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32"}
        jobs.append((fused._lora_gemm_kernel, pointers,
                     dict(HAS_LORA=False, HAS_BIAS=False, HAS_SCALES=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
                          BLOCK_R=16, GROUP_M=8, DOT_PRECISION="tf32"), {"num_warps": 8, "num_stages": 4}))
    results = {}
    for variant, job in zip(_variant_ids(), jobs):
        try:
            compiled = compile_for_hopper(*job)
            ok = bool(compiled.asm["cubin"]) and ".target sm_90" in compiled.asm["ptx"]
            results[variant] = "ok" if ok else "no sm_90 cubin"
        except Exception as error:  # reported per variant by the tests below
            results[variant] = f"{type(error).__name__}: {str(error)[:2000]}"
    return results


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", _variant_ids())
def test_kernel_variant_compiles_for_sm90(compiled, variant):
    assert compiled[variant] == "ok", compiled[variant]


if __name__ == "__main__":
    print(json.dumps(compile_all()))
