"""Shared fixtures: tiny random models (no hub, no downloads) and comparison helpers."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

# Without a GPU the Triton kernels run under the interpreter (it must be on before triton.jit runs,
# so before sits_lora is imported). On a GPU machine the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist each worker gets its share of the cores, for its own ops and the processes it starts
    (notebook kernels, ranks, recipes). Every worker's thread pool sized to all the cores makes OpenMP threads of
    several processes contend for each core: tests that take seconds alone then took minutes in the whole suite.
    A thread count the caller set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_among_workers()

import sits_lora  # noqa: E402,F401  (registers SITS_LORA with PEFT)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO_ROOT, "bench")


def without_deepspeed_shm_build(env: dict) -> dict:
    """``env`` for a process that starts DeepSpeed on CPU ranks, with tests/distributed/no_shm_build on PYTHONPATH:
    DeepSpeed's shared-memory allreduce extension is not compiled (gloo's allreduce runs instead)."""
    folder = os.path.join(REPO_ROOT, "tests", "distributed", "no_shm_build")
    inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (folder, inherited) if p)}


def bench_module(name: str):
    """A script of bench/ imported by its path, for the tests of the benchmarks (bench/ is not a package; the
    tests do not put it on sys.path, the scripts add their own folder to find their siblings)."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH_DIR, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_llama(seed: int = 0, dtype=torch.float32, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype)
    model.eval()
    return model


class TinyMLP(nn.Module):
    """Linear layers with bias, odd sizes, and a leading-dims-agnostic forward."""

    def __init__(self, d_in=24, d_hidden=37, d_out=19):
        super().__init__()
        self.lin0 = nn.Linear(d_in, d_hidden, bias=True)
        self.act = nn.GELU()
        self.lin1 = nn.Linear(d_hidden, d_out, bias=True)

    def forward(self, x):
        return self.lin1(self.act(self.lin0(x)))


def tiny_mlp(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyMLP().to(dtype).eval()


def randomize_lora_weights(model: nn.Module, seed: int = 1) -> None:
    """B starts at zero in LoRA; give every adapter weight random values so gradients are non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.1)


def clone_model(model):
    return copy.deepcopy(model)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_autocast_step_like_peft(sits, peft, ids, device_type: str, dtype) -> None:
    """One training step of each model on ``ids`` under autocast to ``dtype``: the same loss (1e-2) and every LoRA
    gradient fp32, finite and PEFT's (5e-2). The two models hold the same weights."""
    losses = []
    for model in (sits, peft):
        with torch.autocast(device_type, dtype=dtype):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert rel_err(losses[0], losses[1]) < 1e-2
    peft_params = dict(peft.named_parameters())
    for n, p in sits.named_parameters():
        if p.requires_grad:
            assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), n
            assert rel_err(p.grad, peft_params[n].grad) < 5e-2, n


# Each GPU test's limit: past it the test fails with its traceback (a CUDA graph that never ends, an order-dependent
# slowdown) and the run goes on with the next test, instead of one test using the device call's whole time.
GPU_TEST_LIMIT_S = float(os.environ.get("SITS_LORA_GPU_TEST_LIMIT", "180"))


class GpuTestTimeout(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import signal
    import threading

    timed = ("gpu" in item.keywords and torch.cuda.is_available() and GPU_TEST_LIMIT_S > 0
             and threading.current_thread() is threading.main_thread())
    if not timed:
        yield
        return
    import faulthandler

    def over(signum, frame):
        raise GpuTestTimeout(f"{item.nodeid} ran past the GPU tests' limit of {GPU_TEST_LIMIT_S:.0f} s "
                             "(SITS_LORA_GPU_TEST_LIMIT)")

    previous = signal.signal(signal.SIGALRM, over)
    signal.setitimer(signal.ITIMER_REAL, GPU_TEST_LIMIT_S)
    # where every thread is, should the alarm not get through (a wait inside CUDA holds the interpreter)
    faulthandler.dump_traceback_later(GPU_TEST_LIMIT_S + 30, exit=False)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without CUDA. SITS_LORA_TEST_ORDER=reverse or shuffle:SEED runs the collected tests in that
    order: a test that leaves the process broken (a CUDA generator, the allocator, a patched module) for the ones
    after it shows up as a failure that moves with the order."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    order = os.environ.get("SITS_LORA_TEST_ORDER", "")
    if not order:
        # pytest-xdist hands each worker a run of consecutive tests and never takes back what it handed out: a test
        # of minutes handed out last keeps one worker busy while the others idle. Started first, it overlaps the rest.
        items.sort(key=lambda item: "starts_first" not in item.keywords)
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        import random

        random.Random(int(order.split(":", 1)[1])).shuffle(items)
    elif order:
        raise pytest.UsageError(f"SITS_LORA_TEST_ORDER={order!r}: use 'reverse' or 'shuffle:SEED' (e.g. shuffle:1)")


def _tiny_tokenizer(texts, vocab_size=300):
    """A byte-level BPE trained on a few texts: a real tokenizer, built offline in a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A local model folder (config, weights, tokenizer) of a tiny random Llama."""
    import inspect

    folder = tmp_path_factory.mktemp("tiny-llama")
    texts = [inspect.getdoc(m) or "" for m in (os, sys, copy, pytest.approx, torch.nn.Linear)] * 3
    tokenizer = _tiny_tokenizer(texts)
    model = tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=128)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def shared_across_workers(tmp_path_factory, name: str, produce):
    """What ``produce(folder)`` returns (JSON), made once for the whole run: the first test that asks, on whichever
    pytest-xdist worker, makes it in a folder the workers share (under a file lock; the others wait for it), and
    every later ask reads it. ``produce`` writes its files under ``folder``, which stays for the session. For an
    expensive run that several tests read alike (a subprocess with the same arguments), not rebuilt per test."""
    import json

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent   # each worker's basetemp is a folder of the run's own
    folder = root / f"shared-{name}"
    with FileLock(str(folder) + ".lock"):
        result = folder / "shared_result.json"
        if not result.exists():
            folder.mkdir(exist_ok=True)
            value = produce(folder)
            result.write_text(json.dumps(value))
        return json.loads(result.read_text())


def code_corpus(folder):
    """40 short code-like documents as a JSON-lines dataset (the recipe's --dataset) in ``folder``."""
    import json

    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x): return x * {i} + {i % 7}\n" * 8}) + "\n"
                              for i in range(40)))
    return corpus


@pytest.fixture
def no_decode_kernel():
    """No-grad calls of <= 64 rows take the one-kernel decode path (sits_lora.ops.decode, tested in
    tests/ops/test_decode.py); tests of the sibling-group and ATen paths at tiny sizes turn it off."""
    from sits_lora import ops

    ops.set_decode_kernel(False)
    try:
        yield
    finally:
        ops.set_decode_kernel(True)


@pytest.fixture
def small_interpreter_blocks(monkeypatch):
    """The interpreter at the small blocks (sits_lora.ops.tuning.SMALL_BLOCKS_CONFIG) rather than its usual large
    ones: the kernel tests' odd shapes then span several programs along every dimension, which is what tests the
    kernels' tiling. Geometry remembered at other blocks is forgotten on the way in and out."""
    from sits_lora.ops import tuning

    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", tuning.SMALL_BLOCKS_CONFIG)
    tuning.forget_answers()
    yield
    tuning.forget_answers()


KERNEL_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops")


@pytest.fixture(autouse=True)
def _kernel_tests_at_small_blocks(request):
    """tests/ops, the kernel tests, run the interpreter at small blocks (small_interpreter_blocks)."""
    if str(request.node.path).startswith(KERNEL_TESTS + os.sep):
        request.getfixturevalue("small_interpreter_blocks")


def _gloo_rank(rank: int, world: int, port: int, queue, body) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)  # the parent's intra-op thread pool does not survive fork: a parallel op would hang
    # a rank left waiting in a collective fails after 30 s, not 30 minutes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        queue.put((rank, body(rank, world)))
    except Exception as error:  # reported, so that the parent does not wait for a result that never comes
        import traceback

        queue.put((rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(body, world: int = 2, timeout: float = 120) -> list:
    """``body(rank, world)`` on ``world`` gloo ranks (forked processes, torch.distributed initialized); what each
    returned, in rank order (a rank that raised returns the error's text)."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # forked children reuse the imported modules: ~1 s, not ~20 s
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(rank, world, port, queue, body)) for rank in range(world)]
    import queue as queues
    import time

    for proc in procs:
        proc.start()
    results: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, value = queue.get(timeout=1.0)
                results[rank] = value
            except queues.Empty:
                # a rank that died without a word (killed, out of memory, a crash in C) leaves nothing to wait for
                dead = [r for r, proc in enumerate(procs) if r not in results and proc.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    what = (f"rank {dead[0]} exited with {procs[dead[0]].exitcode}" if dead
                            else f"no result in {timeout} s")
                    raise RuntimeError(f"on_gloo_ranks: {what}; results so far: {sorted(results)}") from None
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
    return [results[rank] for rank in range(world)]
