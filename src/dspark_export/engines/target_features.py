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
`new_key`/`new_value` outputs are not requested. With the quantized graphs' exact attention, a second change
(`_empty_cache_prefill`) drops the work that only a non-empty cache needs; the features keep their bits.
Dimension letters as in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..exporter.quantize import EXACT_MAX_KEYS, aligned
from ..plugins import cpu_ops
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
    if not chain or chain[-1].op_type not in ("Gemm", "MatMul", "MatMulNBits", "MatMulW4A8", "FusedMatMul",
                                             "MatMulIntegerToFloat"):
        raise ConfigError(f"{path}: expected 'logits' to come from the LM head's GEMM, found "
                          f"{[n.op_type for n in chain]}")
    normed = chain[-1].input[0]
    if chain[-1].op_type == "MatMulIntegerToFloat":   # w8a8 (exporter.quantize.matmul_w8a8): the head quantizes
        normed = producer[normed].input[0]            # its rows first; the hidden state is the QuantizeLinear's x
        chain += _quantization_of(graph, chain[-1], normed)
    for node in chain:
        graph.node.remove(node)
    keep = [o for o in graph.output if o.name == "aux_hidden"]
    del graph.output[:]
    graph.output.extend(keep)
    graph.output.append(onnx.helper.make_tensor_value_info(normed, onnx.TensorProto.FLOAT, None))
    return model, normed


def _quantization_of(graph, head, hidden: str) -> list:
    """The nodes between `hidden` and the w8a8 `head` that nothing else reads (its per-row quantization)."""
    producer = {out: n for n in graph.node for out in n.output}
    found, stack = {}, [i for i in head.input if i and i != hidden]
    while stack:
        node = producer.get(stack.pop())
        if node is not None and id(node) not in found:
            found[id(node)] = node
            stack += [i for i in node.input if i and i != hidden]
    outputs = {o.name for o in graph.output}
    while True:   # keep a node another (kept) node or a graph output still reads
        read = {i for n in graph.node if id(n) not in found and n is not head for i in n.input}
        kept = [k for k, n in found.items() if any(o in read or o in outputs for o in n.output)]
        if not kept:
            return list(found.values())
        for k in kept:
            del found[k]


def _empty_cache_prefill(graph) -> int:
    """Specialise the exact attention (`exporter/target.py: _exact_attention`) of every layer to the one feed
    `EngineFeatures` gives: one request, cache_lens 0, Q = T new rows, an all-zero cache of P = aligned(T)
    entries. Returns the number of layers rewritten (0: not the exact attention; the graph is left alone).

    Why: with an empty cache the exact attention does part of its work twice (the cache's chunks multiplied,
    then every chunk again as a "hot" one) and scatters the new keys' scores element by element
    (reports/drafter/features-prefill.md has the speed). Same bits, because only copies change:
    - scores: ScatterElements(s_past, slot, s_new) -> Pad(s_new) to P keys. The scatter wrote s_new at keys
      0..T-1 and kept s_past = alpha·(q·0) = ±0 at keys T..P-1, which the causal mask (key <= query) sets to
      -inf for every row, as it does the Pad's +0.
    - values: the chunk GEMM reads Pad(v_new) to P rows instead of the zero cache, and its partials are the
      result (the hot chunks' GatherND/ScatterND/GEMM go): with cache_lens 0 the hot chunks are chunks
      0..H-1 holding exactly those rows, the others hold zeros either way, and the GEMM is the same FusedMatMul
      (shapes, alpha) on the same values.
    """
    import onnx
    from onnx import helper

    nodes = list(graph.node)
    producer = {out: n for n in nodes for out in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    def only(name: str, op_type: str):
        found = [n for n in consumers.get(name, []) if n.op_type == op_type]
        return found[0] if len(found) == 1 else None

    inputs = {i.name for i in graph.input}
    layers = []   # (values Reshape, hot chunks' new-value ScatterND, partial ScatterND, cache GEMM)
    for gemm in nodes:
        values = producer.get(gemm.input[1]) if gemm.op_type == "FusedMatMul" and len(gemm.input) > 1 else None
        if values is None or values.op_type != "Reshape" or not values.input[0].startswith("past_value.") \
                or values.input[0] not in inputs:
            continue
        gather = only(values.output[0], "GatherND")
        hot = only(gather.output[0], "Reshape") if gather is not None else None
        new_values = only(hot.output[0], "ScatterND") if hot is not None else None
        partials = only(gemm.output[0], "ScatterND")
        if new_values is None or partials is None:
            return 0
        layers.append((values, new_values, partials, gemm))
    scatters = [n for n in nodes if n.op_type == "ScatterElements"]   # the new keys' scores, one per layer
    if not layers or len(scatters) != len(layers) or len({n.input[1] for n in scatters}) != 1:
        return 0

    def const(name: str, values: list[int]) -> str:
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    n = "empty_cache_prefill"
    shape = [helper.make_node("Shape", ["past_key.0"], [f"{n}/past_shape"], start=2, end=3),     # [P]
             helper.make_node("Shape", ["pad_index"], [f"{n}/q"], start=1, end=2),                # [Q]
             helper.make_node("Sub", [f"{n}/past_shape", f"{n}/q"], [f"{n}/extra"]),
             helper.make_node("Concat", [const(f"{n}/zeros7", [0] * 7), f"{n}/extra"], [f"{n}/key_pads"], axis=0),
             helper.make_node("Concat", [const(f"{n}/zeros6", [0] * 6), f"{n}/extra", const(f"{n}/zero1", [0])],
                              [f"{n}/row_pads"], axis=0)]
    for node in scatters:                           # [R,kvH,G·Q,Q] -> [R,kvH,G·Q,P]
        node.op_type = "Pad"
        del node.attribute[:]
        node.input[:] = [node.input[2], f"{n}/key_pads"]
    renamed = {}
    for values, new_values, partials, gemm in layers:
        padded = f"{values.output[0]}/{n}"             # [R,kvH,Q,D] -> [R,kvH,P,D]
        graph.node.insert(list(graph.node).index(values),
                          helper.make_node("Pad", [new_values.input[2], f"{n}/row_pads"], [padded]))
        values.input[0] = padded
        renamed[partials.output[0]] = gemm.output[0]
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    for i, node in enumerate(shape):
        graph.node.insert(i, node)
    live = {o.name for o in graph.output}            # drop what no output reads any more
    kept = []
    for node in reversed(list(graph.node)):
        if any(out in live for out in node.output):
            kept.append(node)
            live.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    return len(layers)


class EngineFeatures:
    """A feature source for `training.features.build_feature_cache` over an engine directory's target.

    Args:
        engine_dir: a `dspark-export build` output.
        threads: ONNX Runtime intra-op threads (0: its default).
        specialise: run the exact attention specialised to an empty cache (`_empty_cache_prefill`; the same
            bits, faster); False runs the graph as the engines do (for tests and profiles).
    Attributes:
        name: recorded in the cache's meta.json ("engine:<weights>:<digest of the target graph's files>",
            from the manifest's sha256 entries: the same weights under any directory name).
        max_tokens: the longest sequence `features` takes (max_position_embeddings; for a quantized
            target also EXACT_MAX_KEYS).
        target_layer_ids: the graph's taps (`aux` is their outputs, in this order).
        hidden_size: H.
        specialised_layers: layers whose attention `_empty_cache_prefill` rewrote (0 for an fp32 target, and for
            dspark.cpu::RaggedAttention, which reads only the live entries already).
    Raises:
        ConfigError: not an engine directory, or a target graph without the expected outputs.
    """

    def __init__(self, engine_dir: str | Path, threads: int = 0, specialise: bool = True):
        import onnxruntime as ort

        from .ort.runner import base_session_options

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
        self.specialised_layers = _empty_cache_prefill(model.graph) if specialise else 0
        so = base_session_options(threads)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        cpu_ops.register_for(so, model)
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
