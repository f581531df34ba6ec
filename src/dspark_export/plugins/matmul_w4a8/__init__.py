"""dspark.cpu::MatMulW4A8: MatMulNBits' int4 product with cheap extra rows, as an ONNX Runtime custom op (CPU).

The op reads MatMulNBits' own inputs (bits 4, block 32, symmetric: B [N, K/32, 16] uint8, scales [N, K/32]
float32) and computes what MatMulNBits at ``accuracy_level`` 4 computes (int8 activations per row and block of
32, exact int32 block sums), so an engine switches kernels by renaming nodes (`use_w4a8`). What differs is the
cost of rows: the kernel (`kernel.cpp`) unpacks each 16-column weight block once and reuses it for up to 8
rows, so the LM head's extra row costs about a quarter of MatMulNBits' and the SmolLM2 target's 8-token pass
1.8 one-token passes instead of 2.4 (reports/quant/w4a8/). A row's output is bitwise the same alone or packed
with others, at any row count and thread count.

The library is compiled from `kernel.cpp` by the system C++ compiler on first use and cached under
``$DSPARK_CACHE_DIR`` (default ``~/.cache/dspark-export``), keyed by the source's hash, like Triton's or
torch.utils.cpp_extension's JIT builds. It uses AVX512-VNNI where the CPU has it and a portable path with the
same results otherwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx

from ...errors import ConfigError, EngineDirError

__all__ = ["DOMAIN", "OP", "library_path", "register", "register_for", "graph_uses_w4a8", "use_w4a8", "use_w4a8_file", "INT4_KERNELS", "matmul_w4a8_numpy",
           "vectorized"]

DOMAIN = "dspark.cpu"  #: apart from "dspark", whose ops are ONNX functions the graphs carry
OP = "MatMulW4A8"
SOURCE = Path(__file__).with_name("kernel.cpp")
#: `build --int4-kernel`: which kernel runs the int4 linear layers (target and drafter)
INT4_KERNELS = ("w4a8", "matmulnbits")
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off"]


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE_DIR", Path.home() / ".cache" / "dspark-export"))


@lru_cache(maxsize=None)
def library_path() -> Path:
    """The compiled custom-op library (built on first call, then reused across processes).

    Raises:
        EngineDirError: no C++ compiler, or the compile failed (the message has the compiler's output).
    """
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    name = f"libdspark_w4a8-{tag}.so"
    out = _cache_dir() / "ops" / name
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:   # a read-only or odd home: build in the temp directory instead
        out = Path(tempfile.gettempdir()) / f"dspark-export-{os.getuid()}" / "ops" / name
        if out.exists():
            return out
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise EngineDirError(f"{OP}: no C++ compiler found to build {SOURCE.name} (set CXX, install g++, or "
                             "build the engines with --int4-kernel matmulnbits)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:   # compile aside, then rename: never a partial .so
        part = Path(tmp) / out.name
        try:
            res = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", str(part)], capture_output=True, text=True)
        except OSError as e:
            raise EngineDirError(f"{OP}: could not run the C++ compiler {compiler} ({e}); set CXX, install g++, "
                                 "or build the engines with --int4-kernel matmulnbits") from e
        if res.returncode != 0:
            raise EngineDirError(f"{OP}: compiling {SOURCE} with {compiler} failed:\n{res.stderr[-4000:]}")
        os.replace(part, out)
    return out


def register(so) -> None:
    """Make `so` (onnxruntime.SessionOptions) know the dspark.cpu domain."""
    so.register_custom_ops_library(str(library_path()))


def register_for(so, graph: str | Path | onnx.ModelProto) -> None:
    """`register` when `graph` has MatMulW4A8 nodes (so graphs without it never need the compiler)."""
    if graph_uses_w4a8(graph):
        register(so)


def graph_uses_w4a8(graph: str | Path | onnx.ModelProto) -> bool:
    """Whether a graph has MatMulW4A8 nodes (a file is read without its external weights)."""
    model = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph), load_external_data=False)
    return any(n.domain == DOMAIN for n in model.graph.node)


def use_w4a8_file(path: Path) -> int:
    """`use_w4a8` on a saved graph, rewritten in place (its external data file is untouched); returns the count."""
    model = onnx.load(str(path), load_external_data=False)
    count = use_w4a8(model)
    if count:
        part = path.with_name(f".{path.name}.part")
        part.write_bytes(model.SerializeToString())
        os.replace(part, path)
    return count


def _eligible(node: onnx.NodeProto) -> bool:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    inputs = list(node.input)
    return (node.op_type == "MatMulNBits" and attrs.get("bits") == 4 and attrs.get("block_size") == 32
            and attrs.get("accuracy_level") == 4 and attrs.get("N", 0) % 16 == 0 and len(inputs) == 3
            and attrs.get("K", 0) % 32 == 0)


def use_w4a8(model: onnx.ModelProto) -> int:
    """Rename every MatMulNBits node MatMulW4A8 computes (int4, block 32, accuracy_level 4, no zero points or
    bias, N a multiple of 16) in place; returns how many. Inputs and initializers stay as they are."""
    count = 0
    for node in model.graph.node:
        if _eligible(node):
            node.op_type, node.domain = OP, DOMAIN
            del node.attribute[:]
            count += 1
    if count and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return count


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    p = ctypes.c_void_p
    lib.dspark_w4a8_matmul.argtypes = [p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, p, p, ctypes.c_int]
    lib.dspark_w4a8_matmul.restype = None
    lib.dspark_w4a8_vectorized.restype = ctypes.c_int
    return lib


def vectorized() -> bool:
    """Whether this CPU runs the AVX512-VNNI path (else the portable one, same results)."""
    return bool(_lib().dspark_w4a8_vectorized())


def matmul_w4a8_numpy(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, portable: bool = False) -> np.ndarray:
    """The op on numpy arrays (tests, benchmarks): x [M, K] float32, packed [N, K/32, 16] uint8, scales
    [N, K/32] float32 -> [M, N] float32."""
    x = np.ascontiguousarray(x, np.float32)
    packed = np.ascontiguousarray(packed, np.uint8)
    scales = np.ascontiguousarray(scales, np.float32)
    n, kb, blob = packed.shape
    if blob != 16 or n % 16 or x.ndim != 2 or x.shape[1] != kb * 32 or scales.size != n * kb:
        raise ConfigError(f"{OP}: expected x [M, K], packed [N, K/32, 16] with N % 16 == 0 and scales [N, K/32]; "
                          f"found x {x.shape}, packed {packed.shape}, scales {scales.shape}")
    y = np.empty((x.shape[0], n), np.float32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    _lib().dspark_w4a8_matmul(ptr(x), x.shape[0], kb * 32, n, ptr(packed), ptr(scales), ptr(y), int(portable))
    return y
