"""Run the dspark Triton kernels in Triton's CPU interpreter, in a worker process started with TRITON_INTERPRET=1.

Triton picks interpreter mode when a function is decorated: the kernels when their modules are
imported, and triton.language's own jit functions (``tl.sum``, ``tl.cumsum``, ...) when triton itself is
first imported (triton 3.x reads ``TRITON_INTERPRET`` in ``triton.jit``, not at launch). In a full
pytest session triton is imported while other modules are collected (transformers imports
torch._dynamo, which imports triton when it is installed), so setting the variable in a test module,
or even in tests/plugins/conftest.py, comes too late and the interpreter then fails with "Cannot call
@triton.jit'd outside of the scope of a kernel". A spawned worker is started with the variable set,
so it imports triton in interpreter mode from the start; the pytest process, and every other test,
never see the variable.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np

_KERNEL_MODULES = (
    "dspark_export.plugins.markov_draft.triton_kernel",
    "dspark_export.plugins.speculative_verify.triton_kernel",
    "dspark_export.plugins.tensorrt_kernels",  # imports the TensorRT-order wrappers of the two kernels
)
_TIMEOUT_S = 300


def _start() -> None:
    """Import the kernels in the worker and check they are interpreted (the flag came with the environment)."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    for name in _KERNEL_MODULES:
        module = importlib.import_module(name)
        kernels = [value for key, value in vars(module).items() if key.endswith("_kernel")]
        assert kernels and all(isinstance(kernel, InterpretedFunction) for kernel in kernels), (name, kernels)


def _run(op_type: str, feeds: dict[str, np.ndarray], options: dict) -> tuple[dict, dict]:
    """(outputs, the inputs as they are after the run) of ``OP_REGISTRY[op_type].triton`` on CPU tensors."""
    import torch

    from dspark_export.plugins.registry import OP_REGISTRY

    tensors = {name: torch.from_numpy(array.copy()) for name, array in feeds.items()}
    outputs = OP_REGISTRY[op_type].triton(tensors, **options)
    return ({name: value.numpy() for name, value in outputs.items()},
            {name: value.numpy() for name, value in tensors.items()})


def _run_trt_order(op_type: str, feeds: dict[str, np.ndarray], fields: dict) -> dict:
    """Outputs of ``tensorrt_kernels.launch_trt_order`` (the plugin's launch: TensorRT argument order) on CPU."""
    import torch

    from dspark_export.plugins.tensorrt_kernels import launch_trt_order

    tensors = {name: torch.from_numpy(array.copy()) for name, array in feeds.items()}
    return {name: value.numpy() for name, value in launch_trt_order(op_type, tensors, fields).items()}


class InterpreterWorker:
    """One spawned process that runs the kernels in the interpreter; ``close`` it when done."""

    def __init__(self) -> None:
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the worker, which Pool starts right here
        try:
            self._pool = multiprocessing.get_context("spawn").Pool(1)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
        try:
            self._pool.apply_async(_start).get(timeout=_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def run(self, op_type: str, feeds: dict[str, np.ndarray], **options) -> tuple[dict, dict]:
        """(outputs, inputs after the run) as numpy; a PluginError in the worker is raised here."""
        return self._pool.apply_async(_run, (op_type, feeds, options)).get(timeout=_TIMEOUT_S)

    def run_trt_order(self, op_type: str, feeds: dict[str, np.ndarray], **fields) -> dict:
        """Outputs of the TensorRT-order kernel launched as the plugin launches it (see ``_run_trt_order``)."""
        return self._pool.apply_async(_run_trt_order, (op_type, feeds, fields)).get(timeout=_TIMEOUT_S)

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
