"""Put on PYTHONPATH for the DeepSpeed test processes: DeepSpeed's shared-memory allreduce for CPU ranks, a C++
extension it compiles the first time a process group starts (about a minute of one core), is left out, and gloo's
allreduce runs instead. The tests check what sits_lora does under ZeRO, not DeepSpeed's CPU collectives."""

import importlib.abc
import importlib.util
import sys


class _LeaveOutSharedMemoryOp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "deepspeed.comm.torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.build_shm_op = lambda: None   # TorchBackend then takes torch.distributed's collectives

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _LeaveOutSharedMemoryOp())
