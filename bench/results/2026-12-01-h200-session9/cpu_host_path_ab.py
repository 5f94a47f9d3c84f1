"""The host path of a sits_lora training step with every Triton launch replaced by a no-op, old source against
new (run: PYTHONPATH=<a tree>/src python cpu_host_path_ab.py <label>). A tiny 4-layer Llama, r8 on the seven
projections, kernel="triton" under TRITON_INTERPRET=1 (so the Triton path's Python runs, not the reference), on
the CPU: what is timed is the Python around the kernels, which is what the reorganization touched."""
import os, sys, time
os.environ["TRITON_INTERPRET"] = "1"
import torch
torch.set_flush_denormal(True)
import sits_lora
from sits_lora.ops import fused
noop = lambda *a, **k: None
for n in ("_SHRINK", "_EXPAND", "_GEMM", "_DY_PASS", "_X_PASS", "_SUM_PARTIALS", "_LIMIT_GRAD"):
    assert hasattr(fused, n), n
    setattr(fused, n, noop)
from transformers import LlamaConfig, LlamaForCausalLM
from peft import get_peft_model
from sits_lora import SitsLoraConfig
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)
model = get_peft_model(LlamaForCausalLM(cfg), SitsLoraConfig(r=8, kernel="triton", target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
model.train()
ids = torch.randint(0, 64, (1, 8))
def step():
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
for _ in range(30):
    step()
best = []
for rep in range(5):
    t = time.perf_counter()
    for _ in range(100):
        step()
    best.append((time.perf_counter() - t) / 100 * 1e3)
print(f"{sys.argv[1]}: {min(best):.3f} ms/step (min of 5 x 100), median {sorted(best)[2]:.3f}")
