import os, torch
print("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "torch", torch.__version__)
a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
def alloc(): torch.cuda.synchronize(); return torch.cuda.memory_allocated() / 2**20
m0 = alloc(); (a @ a); m1 = alloc(); print(f"first matmul, default stream: +{m1 - m0:.1f} MiB")
(a @ a.t()).sum().item(); m1b = alloc(); print(f"second matmul default: +{m1b - m1:.1f} MiB")
s = torch.cuda.Stream()
with torch.cuda.stream(s): a @ a
m2 = alloc(); print(f"matmul on a side stream: +{m2 - m1b:.1f} MiB")
s2 = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
with torch.cuda.stream(s2):
    a @ a
torch.cuda.synchronize(); m3 = alloc(); print(f"warm-up on a second side stream: +{m3 - m2:.1f} MiB")
with torch.cuda.graph(g):
    out = a @ a
m4 = alloc(); print(f"capture (output {out.numel()*2/2**20:.1f} MiB): +{m4 - m3:.1f} MiB")
g.replay(); m5 = alloc(); print(f"replay: +{m5 - m4:.1f} MiB")
