"""The ``dspark.cpu`` custom-op library: C++ kernels of ONNX Runtime's CPU provider, compiled on first use.

Ops (one source each, registered together by ``register.cpp``; the C API plumbing is ``ort_api.h``):
- ``MatMulW4A8`` (``matmul_w4a8.cpp``): MatMulNBits' int4 product with cheap extra rows (``plugins/matmul_w4a8``).
- ``MarkovDraftGreedy`` (``markov_draft_greedy.cpp``): the greedy slots of ``dspark::MarkovDraft`` in one pass per
  slot, used inside the op's ONNX function (``markov_draft/onnx_function.py: use_cpu_greedy``).
- ``RaggedAttention`` (``ragged_attention.cpp``): the quantized target's attention over a packed ragged batch, the
  KV cache read in place, sums in one fixed order per row (``exporter/target.py``, ``attention="cpu"``).

The library is compiled by the system C++ compiler and cached under ``$DSPARK_CACHE_DIR`` (default
``~/.cache/dspark-export``), keyed by the sources' hash, like Triton's or torch.utils.cpp_extension's JIT builds.
The kernels use AVX512 where the CPU has it and portable paths with the same results otherwise
(``DSPARK_W4A8_PORTABLE=1`` forces the portable paths). The domain is apart from ``dspark``, whose ops are ONNX
functions the graphs carry.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx

from ...errors import ConfigError, EngineDirError

__all__ = ["DOMAIN", "RAGGED_ATTENTION", "manifest_key", "ragged_attention_fits", "SOURCES", "library_path", "library",
           "register", "register_for", "graph_uses_cpu_ops", "cpu_op_types", "rewrite_graph_file", "markov_draft_greedy",
           "ragged_attention"]

DOMAIN = "dspark.cpu"
RAGGED_ATTENTION = "RaggedAttention"   #: the attention op's name (ragged_attention.cpp)
_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("matmul_w4a8.cpp", "markov_draft_greedy.cpp", "ragged_attention.cpp",
                                          "register.cpp"))
HEADERS = (_HERE / "ort_api.h", _HERE / "exp_poly.h")
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off"]
_FALLBACK = ("set CXX, install g++, or build the engines with --int4-kernel matmulnbits --attention-kernel onnx "
             "--markov-draft-kernel onnx")


def manifest_key(op: str) -> str:
    """The key under which an engine directory's manifest lists a dspark.cpu op its graphs use (`plugins`)."""
    return f"{DOMAIN}::{op}"


def ragged_attention_fits(head_dim: int) -> bool:
    """Whether RaggedAttention takes heads of `head_dim` (a multiple of 16 up to 512); exporters keep ONNX ops
    otherwise."""
    return head_dim % 16 == 0 and 0 < head_dim <= 512


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE_DIR", Path.home() / ".cache" / "dspark-export"))


@lru_cache(maxsize=None)
def library_path() -> Path:
    """The compiled library (built on first call, then reused across processes).

    Raises:
        EngineDirError: no C++ compiler, or the compile failed (the message has the compiler's output).
    """
    digest = hashlib.sha256(" ".join(_FLAGS).encode())
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    name = f"libdspark_cpu-{digest.hexdigest()[:16]}.so"
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
        raise EngineDirError(f"{DOMAIN} ops: no C++ compiler found to build {', '.join(p.name for p in SOURCES)} "
                             f"({_FALLBACK})")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:   # compile aside, then rename: never a partial .so
        part = Path(tmp) / out.name
        try:
            res = subprocess.run([compiler, *_FLAGS, *map(str, SOURCES), "-o", str(part)], capture_output=True,
                                 text=True)
        except OSError as e:
            raise EngineDirError(f"{DOMAIN} ops: could not run the C++ compiler {compiler} ({e}); {_FALLBACK}") from e
        if res.returncode != 0:
            raise EngineDirError(f"{DOMAIN} ops: compiling {_HERE} with {compiler} failed:\n{res.stderr[-4000:]}")
        os.replace(part, out)
    return out


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The library loaded for its direct entry points (tests, benchmarks)."""
    return ctypes.CDLL(str(library_path()))


def register(so) -> None:
    """Make `so` (onnxruntime.SessionOptions) know the dspark.cpu domain."""
    so.register_custom_ops_library(str(library_path()))


def register_for(so, graph: str | Path | onnx.ModelProto) -> None:
    """`register` when `graph` uses a dspark.cpu op (so graphs without one never need the compiler)."""
    if graph_uses_cpu_ops(graph):
        register(so)


def graph_uses_cpu_ops(graph: str | Path | onnx.ModelProto) -> bool:
    """Whether a graph has a dspark.cpu node: in its graph, its local functions or their subgraphs (a file is
    read without its external weights)."""
    return bool(cpu_op_types(graph))


def cpu_op_types(graph: str | Path | onnx.ModelProto) -> frozenset[str]:
    """The dspark.cpu op types a graph uses (in its graph, its local functions or their subgraphs), e.g.
    {RAGGED_ATTENTION, "MatMulW4A8"}; a file is read without its external weights."""
    model = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph), load_external_data=False)
    found: set[str] = set()
    for nodes in (model.graph.node, *(f.node for f in model.functions)):
        _collect_cpu_ops(nodes, found)
    return frozenset(found)


def _collect_cpu_ops(nodes, found: set[str]) -> None:
    for node in nodes:
        if node.domain == DOMAIN:
            found.add(node.op_type)
        for attr in node.attribute:
            for g in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                _collect_cpu_ops(g.node, found)


def rewrite_graph_file(path: Path, rewrite: Callable[[onnx.ModelProto], int]) -> int:
    """Apply `rewrite` (in place, returns a count) to a saved graph and save it when the count is not 0; the
    graph's external data file is untouched and the file is replaced whole (written aside, then renamed)."""
    model = onnx.load(str(path), load_external_data=False)
    count = rewrite(model)
    if count:
        part = path.with_name(f".{path.name}.part")
        part.write_bytes(model.SerializeToString())
        os.replace(part, path)
    return count


def markov_draft_greedy(base_logits: np.ndarray, anchor_ids: np.ndarray, markov_w1: np.ndarray,
                        markov_w2: np.ndarray, d2t: np.ndarray | None = None,
                        portable: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """MarkovDraftGreedy on numpy arrays (tests, benchmarks): base_logits [R, γ, Vd] float32, anchor_ids [R]
    int64, markov_w1 [V, r], markov_w2 [Vd, r] float32, d2t [Vd] int64 or None -> (draft_ids [R, γ] int64,
    draft_logits [R, γ, Vd] float32). ``portable`` forces the portable path (same bits).

    Raises:
        ConfigError: shapes that do not fit together, or a token fed to W1 outside [0, V).
    """
    u = np.ascontiguousarray(base_logits, np.float32)
    anchor = np.ascontiguousarray(anchor_ids, np.int64)
    w1 = np.ascontiguousarray(markov_w1, np.float32)
    w2 = np.ascontiguousarray(markov_w2, np.float32)
    d2t = None if d2t is None else np.ascontiguousarray(d2t, np.int64)
    if (u.ndim != 3 or anchor.shape != u.shape[:1] or w1.ndim != 2 or w2.shape != (u.shape[2], w1.shape[1])
            or (d2t is None and w1.shape[0] != u.shape[2]) or (d2t is not None and d2t.shape != u.shape[2:])):
        raise ConfigError(f"MarkovDraftGreedy: expected base_logits [R, γ, Vd], anchor_ids [R], markov_w1 [V, r], "
                          f"markov_w2 [Vd, r], d2t [Vd] (V = Vd without it); found {u.shape}, {anchor.shape}, "
                          f"{w1.shape}, {w2.shape}, {None if d2t is None else d2t.shape}")
    ids = np.zeros(u.shape[:2], np.int64)
    logits = np.zeros(u.shape, np.float32)
    fn = library().dspark_markov_draft_greedy
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, i64, p, p, i64, i64, p, p, p, p, ctypes.c_int]
    fn.restype = ctypes.c_int
    ptr = lambda a: None if a is None else a.ctypes.data_as(p)  # noqa: E731
    status = fn(ptr(u), u.shape[0], u.shape[1], u.shape[2], ptr(anchor), ptr(w1), w1.shape[0], w1.shape[1], ptr(w2),
                ptr(d2t), ptr(ids), ptr(logits), int(portable))
    if status:
        raise ConfigError(f"MarkovDraftGreedy: a token fed to markov_w1 is outside [0, V={w1.shape[0]}) "
                          "(anchor_ids or d2t out of range)")
    return ids, logits


def ragged_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, past_key: np.ndarray, past_value: np.ndarray,
                     query_start: np.ndarray, cache_lens: np.ndarray, scale: float, causal: bool = True,
                     portable: bool = False) -> np.ndarray:
    """RaggedAttention on numpy arrays (tests): q [N, nH·D], k and v [N, kvH·D], past_key and past_value
    [R, kvH, P, D] float32, query_start [R+1], cache_lens [R] int64 -> [N, nH·D] float32 (`causal` False: every
    row sees all its request's keys; `portable`: the portable path, same bits). Shapes are the op's (ragged_attention.cpp); this entry does not check them."""
    arrays = [np.ascontiguousarray(a, np.float32) for a in (q, k, v, past_key, past_value)]
    qs, lens = (np.ascontiguousarray(a, np.int64) for a in (query_start, cache_lens))
    r, kvh, cap, d = arrays[3].shape
    out = np.zeros(arrays[0].shape, np.float32)
    fn = library().dspark_ragged_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p] * 7 + [i64] * 5 + [ctypes.c_float, ctypes.c_int, p, ctypes.c_int]
    fn.restype = ctypes.c_int
    ptr = lambda a: a.ctypes.data_as(p)  # noqa: E731
    fn(*map(ptr, arrays), ptr(qs), ptr(lens), r, arrays[0].shape[-1] // d, kvh, d, cap, scale, int(causal), ptr(out),
       int(portable))
    return out
