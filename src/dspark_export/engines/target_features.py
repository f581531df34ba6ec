"""Drafter-training features from an engine directory's target graph, as its engines compute them.

`EngineFeatures(engine_dir).features(tokens)` runs the target graph once over a whole sequence (a prefill
with an empty KV cache) and returns the tapped layers' outputs `aux` [T, F] and the final-normed hidden
state `last` [T, H], the two arrays `training.features` caches. Why from the engine: the drafter reads
the engine's features at inference, and on a quantized build they are not the float target's (int4 taps
sit 10-27 % away in relative L2, reports/runtime_split/s13/), so a drafter for it should be trained on
them. The cost: on a CPU with AMX the transformers target in bfloat16 prefills ~3x faster.

The graph is the engine's own `graphs/target.onnx` with one change made in memory: the LM head (its GEMM
and any Identity/Reshape after it) is dropped, and the GEMM's input (the final-normed rows that
`logit_rows` picks, here every row) becomes the output `last_hidden` [T, H]; the per-layer
`new_key`/`new_value` outputs are not requested. Dimension letters as in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..exporter.quantize import EXACT_MAX_KEYS, aligned
from .manifest import Manifest

__all__ = ["EngineFeatures"]


def _feature_graph(path: Path):
    """The target graph at `path` (external data loaded) with `last_hidden` [M, H] in place of `logits`."""
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    producer = {out: n for n in graph.node for out in n.output}
    chain, name = [], "logits"
    while name in producer and (not chain or chain[-1].op_type in ("Identity", "Reshape")):
        chain.append(producer[name])
        name = chain[-1].input[0]
    if not chain or chain[-1].op_type not in ("Gemm", "MatMul", "MatMulNBits", "FusedMatMul"):
        raise ConfigError(f"{path}: expected 'logits' to come from the LM head's GEMM, found "
                          f"{[n.op_type for n in chain]}")
    normed = chain[-1].input[0]
    for node in chain:
        graph.node.remove(node)
    keep = [o for o in graph.output if o.name == "aux_hidden"]
    del graph.output[:]
    graph.output.extend(keep)
    graph.output.append(onnx.helper.make_tensor_value_info(normed, onnx.TensorProto.FLOAT, None))
    return model, normed


class EngineFeatures:
    """A feature source for `training.features.build_feature_cache` over an engine directory's target.

    Args:
        engine_dir: a `dspark-export build` output.
        threads: ONNX Runtime intra-op threads (0: its default).
    Attributes:
        name: recorded in the cache's meta.json ("engine:<weights>:<digest of the target graph's files>",
            from the manifest's sha256 entries: the same weights under any directory name).
        max_tokens: the longest sequence `features` takes (max_position_embeddings; for a quantized
            target also EXACT_MAX_KEYS).
        target_layer_ids: the graph's taps (`aux` is their outputs, in this order).
        hidden_size: H.
    Raises:
        ConfigError: not an engine directory, or a target graph without the expected outputs.
    """

    def __init__(self, engine_dir: str | Path, threads: int = 0):
        import onnxruntime as ort

        manifest = Manifest.load(Path(engine_dir), verify=False)
        spec = manifest.data["graphs"]["target"]["spec"]
        self.target_layer_ids = [int(i) for i in spec["tap_layer_ids"]]
        self.hidden_size = int(spec["hidden_size"])
        self._layers, self._kv_heads, self._head_dim = (int(spec[k]) for k in ("num_layers", "num_kv_heads",
                                                                               "head_dim"))
        self.weights = spec.get("weights", "fp32")
        self.max_tokens = int(spec["max_position_embeddings"])
        if self.weights != "fp32":
            self.max_tokens = min(self.max_tokens, EXACT_MAX_KEYS)
        files = manifest.data.get("files", {})
        graph = manifest.data["graphs"]["target"]
        digest = hashlib.sha256("".join(files.get(rel, {}).get("sha256", rel) for rel in
                                        (graph["path"], graph.get("data") or "")).encode()).hexdigest()
        self.name = f"engine:{self.weights}:{digest[:16]}"
        model, self._last = _feature_graph(manifest.graph_path("target"))
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = int(threads)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def features(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """aux [T, F] and last [T, H] float32 for one sequence `tokens` [T] (its first token at position 0)."""
        ids = np.asarray(tokens, np.int64).reshape(-1)
        T = int(ids.size)
        if not 0 < T <= self.max_tokens:
            raise ConfigError(f"features: expected a sequence of 1 to {self.max_tokens} tokens (the target's "
                              f"{'position range' if self.weights == 'fp32' else 'position range and exact attention'}"
                              f"), found {T}; cut it shorter (build_feature_cache's max_tokens)")
        rows = np.arange(T, dtype=np.int64)
        # an empty cache; the quantized graphs' exact attention places the T new keys inside the cache's key
        # axis, so theirs holds aligned(T) (unwritten) entries (exporter/target.py, the I/O contract)
        entries = 0 if self.weights == "fp32" else aligned(T)
        empty = np.zeros((1, self._kv_heads, entries, self._head_dim), np.float32)
        feed = {"input_ids": ids, "position_ids": rows, "query_start": np.array([0, T], np.int64),
                "cache_lens": np.zeros(1, np.int64), "pad_index": rows[None, :], "logit_rows": rows,
                **{f"past_{kv}.{l}": empty for l in range(self._layers) for kv in ("key", "value")}}
        aux, last = self.session.run(["aux_hidden", self._last], feed)
        return aux, last.reshape(T, self.hidden_size)
