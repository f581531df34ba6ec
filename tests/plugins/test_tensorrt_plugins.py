"""TensorRT plugins of the dspark ops: what can be checked without TensorRT, and the real build where it exists.

Without TensorRT (this machine): the plugin spec (shape/type rules, fields, placeholders) against the ONNX
schema and against ONNX shape inference of the ops' function bodies; the TensorRT-order kernels (inputs,
int32 scalars, outputs: the plugin's launch) against the numpy reference in Triton's CPU interpreter; the
ahead-of-time PTX for sm_90 (entry trimmed to exactly the launch's parameters, re-assembled by ptxas); and
the ``tensorrt.plugin`` definitions' signatures and launch parameters, called through a recording stand-in
of the documented ``tensorrt.plugin`` API (it checks our side of the contract, not TensorRT's).
With TensorRT and a GPU: the plugins are registered and a lowered single-op graph is built and run.
"""

import inspect
import json
import os
import subprocess
import sys
import typing
import zlib

import numpy as np
import numpy.typing as npt
import onnx
import pytest

from dspark_export.engines.trt import has_tensorrt, tensorrt_unavailable_reason
from dspark_export.errors import BuildError, PluginError
from dspark_export.plugins.graph import make_op_model
from dspark_export.plugins.markov_draft import reference as markov_reference
from dspark_export.plugins.speculative_verify import reference as verify_reference
from dspark_export.plugins.common.tensorrt_spec import DEFAULT_BLOCK_V, DEFAULT_NUM_PROBES
from dspark_export.plugins.registry import PLUGIN_SPECS
from dspark_export.plugins.common.triton_support import has_triton
from plugin_cases import MARKOV_CONFIGS, markov_feeds, verify_feeds

needs_triton = pytest.mark.skipif(
    not has_triton(), reason="triton does not import (pip install 'dspark-export[triton]'), so the kernels cannot run")
needs_tensorrt = pytest.mark.skipif(
    not has_tensorrt(), reason=f"TensorRT is not installed here ({tensorrt_unavailable_reason()}); the plugins "
                               "need TensorRT >= 10.9 and a GPU (scripts/gpu_check.sh runs this test there)")
SMALL = dict(block_v=16, num_probes=16)  # V = 37, 50: masked tail blocks


# -- the spec against the ONNX schema and ONNX shape inference ------------------------------------------------

@pytest.mark.parametrize("op", sorted(PLUGIN_SPECS))
def test_output_rules_restate_the_schema(op):
    spec = PLUGIN_SPECS[op]
    schema = spec.schema
    assert [r.name for r in spec.outputs] == list(schema.output_names)
    for rule, out in zip(spec.outputs, schema.outputs):
        assert rule.dtype == out.dtype
        assert tuple(schema.input(src).shape[axis] for src, axis in rule.dims) == out.shape, rule
    assert dict(spec.placeholders) == {s.name: len(s.shape) for s in schema.inputs if s.optional}
    assert spec.plugin_id == f"dspark::{op}"


def _concrete_op_model(op, config, dims):
    return make_op_model(op, config, dims=dims)


CASES = [("MarkovDraft", dict(block_size=3, **c), {"R": 2, "V": 37, "H": 8, "r": 5 if c["has_markov"] else 0})
         for c in MARKOV_CONFIGS.values()] + [("SpeculativeVerify", {}, {"R": 3, "M": 9, "V": 37, "γ": 4})]


@pytest.mark.parametrize("op,config,dims", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_output_rules_agree_with_onnx_shape_inference(op, config, dims):
    """Pin every dim, run ONNX shape inference through the op's function body, compare with the plugin rule."""
    model = _concrete_op_model(op, config, dims)
    # drop the declared output shapes so that inference has to compute them from the body
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    dim = lambda d: d.dim_value if d.HasField("dim_value") else None  # noqa: E731
    found = {o.name: tuple(dim(d) for d in o.type.tensor_type.shape.dim)
             for o in [*inferred.graph.value_info, *inferred.graph.output]
             if o.name in PLUGIN_SPECS[op].schema.output_names and o.type.tensor_type.HasField("shape")}
    shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
    expected = PLUGIN_SPECS[op].output_shapes(shapes)
    assert found == expected


def test_fields_are_checked():
    spec = PLUGIN_SPECS["MarkovDraft"]
    assert spec.check_fields({"has_markov": True, "has_confidence": 0}) == {
        "has_markov": 1, "has_confidence": 0, "block_v": DEFAULT_BLOCK_V, "num_probes": DEFAULT_NUM_PROBES}
    with pytest.raises(PluginError, match="'has_markov' expected one of"):
        spec.check_fields({"has_markov": 2, "has_confidence": 0})
    with pytest.raises(PluginError, match="'has_confidence' expected an int"):
        spec.check_fields({"has_markov": 1})
    with pytest.raises(PluginError, match="unknown plugin fields"):
        PLUGIN_SPECS["SpeculativeVerify"].check_fields({"has_markov": 1})
    with pytest.raises(PluginError, match="'block_v' expected a power of two >= 16"):
        PLUGIN_SPECS["SpeculativeVerify"].check_fields({"block_v": 8})


@needs_triton
def test_spec_defaults_are_the_kernels_defaults():
    from dspark_export.plugins.markov_draft import triton_kernel as mk
    from dspark_export.plugins.speculative_verify import triton_kernel as vk

    assert DEFAULT_BLOCK_V == mk.DEFAULT_BLOCK_V == vk.DEFAULT_BLOCK_V
    assert DEFAULT_NUM_PROBES == mk.DEFAULT_NUM_PROBES == vk.DEFAULT_NUM_PROBES


# -- the plugin's launch (TensorRT argument order) in the interpreter --------------------------------------

@pytest.fixture(scope="module")
def worker():
    from triton_interpreter import InterpreterWorker

    interpreter = InterpreterWorker()
    yield interpreter
    interpreter.close()


@needs_triton
@pytest.mark.parametrize("tag", sorted(MARKOV_CONFIGS))
def test_trt_order_markov_draft_matches_reference(worker, tag):
    config = dict(block_size=3, **MARKOV_CONFIGS[tag])
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    feeds = markov_feeds(rng, "mixed", config, num_requests=4, vocab=37)
    fields = dict(has_markov=int(config["has_markov"]), has_confidence=int(config["has_confidence"]), **SMALL)
    actual = worker.run_trt_order("MarkovDraft", feeds, **fields)
    expected = markov_reference.run(feeds)
    np.testing.assert_array_equal(actual["draft_ids"], expected["draft_ids"])
    np.testing.assert_allclose(actual["draft_logits"], expected["draft_logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(actual["confidence"], expected["confidence"], rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("case", ["greedy", "mixed", "top_p"])
def test_trt_order_verify_matches_reference(worker, case):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    feeds = verify_feeds(rng, case, [3, 0, 4, 1, 2], gamma=4, vocab=37)
    actual = worker.run_trt_order("SpeculativeVerify", feeds, **SMALL)
    expected = verify_reference.run(feeds)
    assert actual["num_accepted"].tolist() == expected["num_accepted"].tolist()
    assert actual["next_ids"].tolist() == expected["next_ids"].tolist()


# -- ahead-of-time compilation for sm_90 ------------------------------------------------------------------

_AOT_SCRIPT = """
import json
from dspark_export.plugins.tensorrt_kernels import assemble, compile_aot, entry_params
found = {}
for op, fields, static in (("SpeculativeVerify", {}, {}),
                           ("MarkovDraft", {"has_markov": 1, "has_confidence": 1}, {"RANK": 32, "H": 576}),
                           ("MarkovDraft", {"has_markov": 0, "has_confidence": 0}, {})):
    k = compile_aot(op, fields, static, capability=90)
    name, params = entry_params(k.ptx)
    cubin = assemble(k, capability=90)
    found[f"{op}/{fields.get('has_markov', '')}"] = dict(
        name=name, kernel=k.name, params=params, num_params=k.num_params, block_x=k.block_x,
        shared=k.shared_mem, target=[l for l in k.ptx.splitlines() if l.startswith(".target")],
        cubin_elf=cubin[:4].hex(), constexprs=k.constexprs)
print(json.dumps(found))
"""


@needs_triton
def test_aot_kernels_compile_for_sm90_with_exactly_the_launch_parameters(tmp_path):
    """Fresh process, no interpreter: PTX for sm_90a whose entry takes inputs + int32 scalars + outputs, in
    that order, and which ptxas assembles again after the trailing scratch parameters are removed."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    from dspark_export.plugins.tensorrt_kernels import SCALARS

    for key, k in found.items():
        op = key.split("/")[0]
        schema = PLUGIN_SPECS[op].schema
        kinds = (["ptr"] * len(schema.inputs) + ["u32"] * len(SCALARS[op]) + ["ptr"] * len(schema.outputs))
        assert k["name"] == k["kernel"] and k["target"] == [".target sm_90a"]
        assert k["num_params"] == len(kinds) == len(k["params"])
        assert ["ptr" if ".u64 .ptr" in p else "u32" if ".u32" in p else p for p in k["params"]] == kinds
        assert k["cubin_elf"] == "7f454c46"  # ELF magic: ptxas accepted the trimmed PTX
        assert k["block_x"] % 32 == 0 and k["shared"] >= 0
    assert found["MarkovDraft/1"]["constexprs"]["BLOCK_R"] == 32 and found["MarkovDraft/1"]["constexprs"]["BLOCK_H"] == 256
    assert found["MarkovDraft/0"]["constexprs"]["HAS_MARKOV"] is False


@needs_triton
def test_aot_needs_a_static_markov_rank():
    from dspark_export.plugins.tensorrt_kernels import compile_aot

    with pytest.raises(PluginError, match="Markov rank"):
        compile_aot("MarkovDraft", {"has_markov": 1, "has_confidence": 0}, {})
    with pytest.raises(PluginError, match="no TensorRT kernel"):
        compile_aot("Nope", {})


# -- the tensorrt.plugin definitions, through a recording stand-in of its documented API --------------------

class _Expr:
    """A shape expression: a symbol or a build-time constant (``is_constant`` / ``constant_value``)."""

    def __init__(self, value):
        self.value, self.is_fake = value, False

    @property
    def is_constant(self):
        return isinstance(self.value, int)

    def constant_value(self):
        return self.value

    def __repr__(self):
        return f"E({self.value})"


class _Recorder:
    """What our definitions call on ``tensorrt`` / ``tensorrt.plugin``, recorded instead of performed."""

    int64, float32 = "INT64", "FLOAT"

    class TensorDesc:
        def __init__(self, dims=(), dtype=None):
            self.shape_expr, self.dtype = [d if isinstance(d, _Expr) else _Expr(d) for d in dims], dtype

    class Tensor:
        pass

    class KernelLaunchParams:
        grid_x = block_x = shared_mem = None

    class SymExprs(list):
        pass

    class SymIntExprs(SymExprs):
        @classmethod
        def from_tuple(cls, items):
            return cls(items)

    @staticmethod
    def SymInt32(expr):
        return ("i32", expr)

    @classmethod
    def from_shape_expr(cls, dims, dtype):
        return cls.TensorDesc(dims, dtype)

    # -- what TensorRT does with the plugin attributes (tensorrt/plugin/_validate.py and _lib.py) --------------
    SERIALIZABLE_BUILTINS = (int, float, bytes, bool, str)
    SERIALIZABLE_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_)

    @classmethod
    def attribute_annotations(cls, register_fn) -> dict:
        """The attributes `register` declares, checked as TensorRT's registration checks them: a builtin, or
        `numpy.typing.NDArray[dtype]` of a serializable dtype."""
        out = {}
        for name, p in inspect.signature(register_fn).parameters.items():
            if p.annotation is cls.TensorDesc:
                continue
            if p.annotation not in cls.SERIALIZABLE_BUILTINS:
                assert typing.get_origin(p.annotation) is np.ndarray, (name, p.annotation)
                assert cls.field_dtype(p.annotation) in cls.SERIALIZABLE_DTYPES, (name, p.annotation)
            out[name] = p.annotation
        return out

    @staticmethod
    def field_dtype(annotation):
        return typing.get_args(typing.get_args(annotation)[1])[0]

    @classmethod
    def creator_attrs(cls, annotations: dict, fields: dict) -> dict:
        """The plugin creator's conversion of the fields it receives (numpy arrays, as the ONNX parser sends
        them): a numpy annotation gives ``data.astype(dtype)``, a builtin one ``annotation(data)``."""
        out = {}
        for name, data in fields.items():
            annotation = annotations[name]
            if typing.get_origin(annotation) is np.ndarray:
                out[name] = data.astype(cls.field_dtype(annotation))
            elif annotation is str:
                out[name] = data.tobytes().decode("utf-8")
            else:
                out[name] = annotation(data)
        return out


def _parser_fields(fields: dict) -> dict:
    """Plugin fields as the ONNX parser passes INT attributes: one-element INT32 arrays."""
    return {name: np.array([int(value)], dtype=np.int32) for name, value in fields.items()}


def _input_descs(op, shapes):
    return {s.name: _Recorder.TensorDesc(shapes[s.name], "INT64" if s.dtype.kind == "i" else "FLOAT")
            for s in PLUGIN_SPECS[op].schema.inputs}


def test_definitions_follow_the_tensorrt_plugin_signatures():
    """Parameter names/order are what tensorrt.plugin's validators require; annotations are classes, not strings."""
    fns = __import__("dspark_export.plugins.tensorrt_plugins", fromlist=["x"]).plugin_functions(_Recorder, _Recorder)
    for op, defs in fns.items():
        spec = PLUGIN_SPECS[op]
        inputs, fields = list(spec.schema.input_names), list(spec.field_names)
        params = {k: list(inspect.signature(f).parameters) for k, f in defs.items()}
        assert params == {"register": inputs + fields, "aot_impl": inputs + fields + ["outputs", "tactic"],
                          "impl": inputs + fields + ["outputs", "stream"]}
        for kind, f in defs.items():
            sig = inspect.signature(f)
            assert all(not isinstance(p.annotation, str) for p in sig.parameters.values()), (op, kind)
            for name in inputs:
                want = _Recorder.TensorDesc if kind != "impl" else _Recorder.Tensor
                assert sig.parameters[name].annotation is want
            for name in fields:  # what the parser sends (a one-element INT32 field); equal in all three
                annotation = sig.parameters[name].annotation
                assert annotation == npt.NDArray[np.int32], (op, kind, name, annotation)
                assert typing.get_origin(annotation) is np.ndarray and _Recorder.field_dtype(annotation) is np.int32
        assert set(_Recorder.attribute_annotations(defs["register"])) == set(fields)
        ret = inspect.signature(defs["register"]).return_annotation
        assert typing.get_origin(ret) is tuple and len(typing.get_args(ret)) == len(spec.outputs)
        ret = typing.get_args(inspect.signature(defs["aot_impl"]).return_annotation)
        assert ret[2] is _Recorder.KernelLaunchParams and ret[3] is _Recorder.SymExprs


@pytest.mark.parametrize("op", sorted(PLUGIN_SPECS))
def test_register_returns_the_rule_shapes(op):
    fns = __import__("dspark_export.plugins.tensorrt_plugins", fromlist=["x"]).plugin_functions(_Recorder, _Recorder)
    symbolic = {s.name: tuple(f"{s.name}[{k}]" for k in range(len(s.shape))) for s in PLUGIN_SPECS[op].schema.inputs}
    descs = _input_descs(op, symbolic)
    fields = PLUGIN_SPECS[op].check_fields({"has_markov": 1, "has_confidence": 1} if op == "MarkovDraft" else {})
    outs = fns[op]["register"](**descs, **fields)
    expected = PLUGIN_SPECS[op].output_shapes(symbolic)
    assert [tuple(e.value for e in o.shape_expr) for o in outs] == [expected[r.name] for r in PLUGIN_SPECS[op].outputs]
    assert [o.dtype for o in outs] == ["INT64" if r.dtype.kind == "i" else "FLOAT" for r in PLUGIN_SPECS[op].outputs]


@needs_triton
def test_aot_impl_launch_parameters_match_the_kernel():
    """grid_x = R (one program per request), block = 32·num_warps, shared memory from the compiled kernel, and
    the extra int32 args are the kernel's scalars in its order, taken from the right input axes."""
    from dspark_export.plugins.tensorrt_kernels import SCALARS, entry_params
    from dspark_export.plugins.tensorrt_plugins import plugin_functions

    fns = plugin_functions(_Recorder, _Recorder, capability=90)
    shapes = {"MarkovDraft": dict(base_logits=("R", 7, "V"), hidden=("R", 7, 576), anchor_ids=("R",),
                                  temperature=("R",), top_k=("R",), top_p=("R",), uniforms=("R", 7),
                                  confidence_temperature=(7,), markov_w1=("V", 32), markov_w2=("V", 32),
                                  confidence_weight=(608,), confidence_bias=(1,)),
              "SpeculativeVerify": dict(target_logits=("M", "V"), query_start=("R1",), draft_ids=("R", 7),
                                        draft_logits=("R", 7, "V"), verify_lens=("R",), temperature=("R",),
                                        top_k=("R",), top_p=("R",), uniforms=("R", 8))}
    for op, shape in shapes.items():
        descs = _input_descs(op, shape)
        fields = PLUGIN_SPECS[op].check_fields({"has_markov": 1, "has_confidence": 1} if op == "MarkovDraft" else {})
        attrs = _Recorder.creator_attrs(_Recorder.attribute_annotations(fns[op]["register"]), _parser_fields(fields))
        outs = fns[op]["register"](**descs, **attrs)
        name, ptx, params, extra = fns[op]["aot_impl"](**descs, **attrs, outputs=outs, tactic=0)
        assert entry_params(ptx)[0] == name
        assert params.grid_x.value == "R" and params.block_x % 32 == 0 and params.shared_mem >= 0
        assert isinstance(extra, _Recorder.SymIntExprs)
        assert [(kind, e.value) for kind, e in extra] == [("i32", shape[src][axis]) for _, (src, axis) in SCALARS[op]]


@pytest.mark.parametrize("op", sorted(PLUGIN_SPECS))
def test_fields_arrive_as_int32_arrays_and_reach_the_kernels_as_checked_ints(op, monkeypatch):
    """The parser's one-element INT32 fields, converted as TensorRT's creator converts them, go through
    register, aot_impl and impl; the kernels get plain ints, checked against the spec."""
    from dspark_export.plugins import tensorrt_plugins as tp

    seen = []
    monkeypatch.setattr(tp, "_aot", lambda trt, trtp, op_, inputs, fields, capability: seen.append(
        ("aot", op_, fields, capability)) or ("k", "ptx", None, None))
    monkeypatch.setattr(tp, "_jit", lambda op_, inputs, fields, outputs, stream: seen.append(("jit", op_, fields)))
    fns = tp.plugin_functions(_Recorder, _Recorder, capability=90)
    symbolic = {s.name: tuple(f"{s.name}[{k}]" for k in range(len(s.shape))) for s in PLUGIN_SPECS[op].schema.inputs}
    descs = _input_descs(op, symbolic)
    fields = PLUGIN_SPECS[op].check_fields({"has_markov": 1, "has_confidence": 0} if op == "MarkovDraft"
                                           else {"block_v": 64, "num_probes": 4})
    attrs = _Recorder.creator_attrs(_Recorder.attribute_annotations(fns[op]["register"]), _parser_fields(fields))
    assert all(isinstance(v, np.ndarray) and v.shape == (1,) and v.dtype == np.int32 for v in attrs.values())
    outs = fns[op]["register"](**descs, **attrs)
    assert len(outs) == len(PLUGIN_SPECS[op].outputs)
    fns[op]["aot_impl"](**descs, **attrs, outputs=outs, tactic=0)
    fns[op]["impl"](**{k: object() for k in descs}, **attrs, outputs=(), stream=0)
    assert seen == [("aot", op, fields, 90), ("jit", op, fields)]
    assert all(type(v) is int for _, _, f, *_ in seen for v in f.values())
    # 0-d arrays and ints are read the same way
    fns[op]["aot_impl"](**descs, **{k: np.int32(v[0]) for k, v in attrs.items()}, outputs=outs, tactic=0)
    fns[op]["aot_impl"](**descs, **{k: int(v[0]) for k, v in attrs.items()}, outputs=outs, tactic=0)
    assert seen[2][2] == seen[3][2] == fields


def test_bad_fields_are_named(monkeypatch):
    from dspark_export.plugins import tensorrt_plugins as tp

    monkeypatch.setattr(tp, "_aot", lambda *a: pytest.fail("reached the kernel"))
    fns = tp.plugin_functions(_Recorder, _Recorder, capability=90)["SpeculativeVerify"]
    descs = _input_descs("SpeculativeVerify", {s.name: (1,) * len(s.shape)
                                               for s in PLUGIN_SPECS["SpeculativeVerify"].schema.inputs})
    good = _parser_fields({"block_v": 64, "num_probes": 4})
    with pytest.raises(PluginError, match="'num_probes': expected one integer .* found int32 of shape \\(2,\\)"):
        fns["aot_impl"](**descs, **{**good, "num_probes": np.array([4, 4], np.int32)}, outputs=(), tactic=0)
    with pytest.raises(PluginError, match="'block_v': expected one integer .* found float32"):
        fns["aot_impl"](**descs, **{**good, "block_v": np.array([64.0], np.float32)}, outputs=(), tactic=0)
    with pytest.raises(PluginError, match="'block_v' expected a power of two"):
        fns["aot_impl"](**descs, **{**good, "block_v": np.array([48], np.int32)}, outputs=(), tactic=0)


# -- the compute capability the AOT kernels are compiled for -----------------------------------------------

def _fake_cudart(major=None, minor=None, fail=None):
    """A stand-in of cuda-python's runtime bindings: every call returns (error, value...)."""
    import enum
    import types

    class Err(enum.Enum):
        cudaSuccess = 0
        cudaErrorNoDevice = 100

    class Attr(enum.Enum):
        cudaDevAttrComputeCapabilityMajor = 75
        cudaDevAttrComputeCapabilityMinor = 76

    values = {Attr.cudaDevAttrComputeCapabilityMajor: major, Attr.cudaDevAttrComputeCapabilityMinor: minor}
    mod = types.ModuleType("cuda.bindings.runtime")
    mod.cudaError_t, mod.cudaDeviceAttr = Err, Attr
    mod.cudaGetDevice = lambda: (Err.cudaErrorNoDevice, 0) if fail == "device" else (Err.cudaSuccess, 0)
    mod.cudaDeviceGetAttribute = lambda attr, device: (Err.cudaSuccess, values[attr])
    return mod


def _fake_torch(capability=None):
    import types

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: capability is not None,
                                       get_device_capability=lambda: capability)
    return torch


@pytest.fixture
def no_sm_env(monkeypatch):
    from dspark_export.plugins.tensorrt_plugins import SM_ENV

    monkeypatch.delenv(SM_ENV, raising=False)
    return SM_ENV


def test_capability_comes_from_the_device(no_sm_env, monkeypatch):
    from dspark_export.plugins.tensorrt_plugins import device_capability

    monkeypatch.setitem(sys.modules, "torch", _fake_torch((9, 0)))
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", _fake_cudart(8, 6))
    assert device_capability() == 90  # torch first
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(None))
    assert device_capability() == 86  # then cuda-python
    monkeypatch.setitem(sys.modules, "torch", None)
    assert device_capability() == 86


def test_capability_unknown_is_an_error_not_sm90(no_sm_env, monkeypatch):
    from dspark_export.plugins import tensorrt_plugins as tp

    monkeypatch.setitem(sys.modules, "torch", _fake_torch(None))
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", _fake_cudart(fail="device"))
    with pytest.raises(BuildError, match="compute capability could not be determined") as e:
        tp.device_capability()
    assert "torch: no CUDA device" in str(e.value) and "cudaGetDevice failed" in str(e.value)
    assert "DSPARK_TRT_SM=90" in str(e.value)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", None)
    monkeypatch.setitem(sys.modules, "cuda.cudart", None)
    with pytest.raises(BuildError, match="cuda-python: not installed"):
        tp.device_capability()
    # the definitions ask only when TensorRT calls aot_impl (building), so loading an engine never needs it
    fns = tp.plugin_functions(_Recorder, _Recorder)["SpeculativeVerify"]
    descs = _input_descs("SpeculativeVerify", {s.name: (1,) * len(s.shape)
                                               for s in PLUGIN_SPECS["SpeculativeVerify"].schema.inputs})
    with pytest.raises(BuildError, match="compute capability could not be determined"):
        fns["aot_impl"](**descs, **_parser_fields({"block_v": 64, "num_probes": 4}), outputs=(), tactic=0)


def test_capability_override(no_sm_env, monkeypatch):
    from dspark_export.plugins.tensorrt_plugins import device_capability

    monkeypatch.setitem(sys.modules, "torch", _fake_torch((9, 0)))
    monkeypatch.setenv(no_sm_env, "89")
    assert device_capability() == 89  # an explicit choice wins over the device
    for bad in ("sm_90", "9", "9.0"):
        monkeypatch.setenv(no_sm_env, bad)
        with pytest.raises(BuildError, match=f"DSPARK_TRT_SM: expected a CUDA compute capability .* found '{bad}'"):
            device_capability()


# -- registration, through stand-in tensorrt modules ---------------------------------------------------------

def _recording_plugin_module(registered: list, with_aot: bool = True) -> dict:
    """tensorrt.plugin's attributes: the stand-in's classes plus register / aot_impl / impl decorators that
    record what they get and check, as TensorRT does, that aot_impl's and impl's attribute annotations equal
    register's."""
    attrs = {name: getattr(_Recorder, name) for name in ("TensorDesc", "Tensor", "SymExprs", "SymIntExprs")}
    declared = {}

    def decorator(kind):
        def by_id(plugin_id):
            def record(fn):
                if kind == "register":
                    declared[plugin_id] = _Recorder.attribute_annotations(fn)
                else:
                    sig = inspect.signature(fn).parameters
                    assert all(sig[n].annotation == a for n, a in declared[plugin_id].items()), (plugin_id, kind)
                registered.append((plugin_id, kind))
                return fn
            return record
        return by_id

    attrs.update(register=decorator("register"), impl=decorator("impl"))
    if with_aot:
        attrs.update(aot_impl=decorator("aot_impl"), KernelLaunchParams=_Recorder.KernelLaunchParams,
                     SymInt32=_Recorder.SymInt32)
    return attrs


def test_register_plugins_defines_both_plugins(fake_tensorrt, no_sm_env, monkeypatch):
    from dspark_export.plugins.tensorrt_plugins import register_plugins

    registered = []
    fake_tensorrt(version="10.16.0.1", plugin=_recording_plugin_module(registered))
    fake_trt = sys.modules["tensorrt"]
    fake_trt.int64, fake_trt.float32 = _Recorder.int64, _Recorder.float32
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(None))  # no GPU: registering must not need one
    assert register_plugins.__wrapped__() == ("dspark::MarkovDraft", "dspark::SpeculativeVerify")
    assert registered == [(f"dspark::{op}", kind) for op in ("MarkovDraft", "SpeculativeVerify")
                          for kind in ("register", "aot_impl", "impl")]


@pytest.mark.parametrize("version,with_aot,why", [
    ("10.8.0.43", True, "TensorRT 10.8.0.43 is older than 10.9"),
    ("10.9.0.34", False, "tensorrt.plugin has no aot_impl, KernelLaunchParams, SymInt32"),
    ("10.9.0.34", None, "has no tensorrt.plugin module"),
])
def test_register_plugins_on_a_tensorrt_without_aot_plugins_says_why(fake_tensorrt, version, with_aot, why):
    from dspark_export.engines.trt import has_tensorrt
    from dspark_export.plugins.tensorrt_plugins import register_plugins

    registered = []
    fake_tensorrt(version=version, plugin=None if with_aot is None else _recording_plugin_module(registered, with_aot))
    assert not has_tensorrt()
    with pytest.raises(BuildError, match="needs TensorRT >= 10.9") as e:
        register_plugins.__wrapped__(90)
    assert why in str(e.value) and registered == []


def test_register_plugins_without_tensorrt_says_why():
    if has_tensorrt():
        pytest.skip("TensorRT is installed here; the refusal path cannot be exercised")
    from dspark_export.plugins.tensorrt_plugins import register_plugins

    with pytest.raises(BuildError, match="needs TensorRT >= 10.9"):
        register_plugins.__wrapped__(90)


# -- with TensorRT and a GPU ------------------------------------------------------------------------------

@needs_tensorrt
@pytest.mark.parametrize("op,config", [("SpeculativeVerify", {}),
                                       ("MarkovDraft", dict(block_size=3, has_markov=True, has_confidence=True)),
                                       ("MarkovDraft", dict(block_size=3, has_markov=False, has_confidence=False))])
def test_plugin_engine_matches_reference(op, config, tmp_path):
    """Register the plugins, build a strongly typed engine from the lowered single-op graph, run it on the GPU."""
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, Profile, TrtRunner

    from dspark_export.engines.trt.lowering import lower_model
    from dspark_export.plugins.tensorrt_plugins import register_plugins

    register_plugins()
    rng = np.random.default_rng(0)
    if op == "MarkovDraft":
        feeds = markov_feeds(rng, "mixed", config, num_requests=4, vocab=37)
        dims = {"R": 4, "V": 37, "H": 8, "r": 5 if config["has_markov"] else 0}
        reference = markov_reference.run(feeds)
    else:
        feeds = verify_feeds(rng, "mixed", [3, 0, 4, 1], gamma=4, vocab=37)
        dims = {"R": 4, "M": int(feeds["target_logits"].shape[0]), "V": 37, "γ": 4}
        reference = verify_reference.run(feeds)
    path = tmp_path / "op.onnx"
    onnx.save(lower_model(make_op_model(op, config, dims=dims), op).model, str(path))
    profile = Profile()
    for name, value in feeds.items():
        profile.add(name, value.shape, value.shape, value.shape)
    engine = EngineFromNetwork(NetworkFromOnnxPath(str(path), strongly_typed=True), CreateConfig(profiles=[profile]))
    with TrtRunner(engine) as runner:
        out = runner.infer(feeds)
    for name, value in reference.items():
        if value.dtype.kind == "i":
            np.testing.assert_array_equal(out[name], value, err_msg=name)
        else:
            np.testing.assert_allclose(out[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
