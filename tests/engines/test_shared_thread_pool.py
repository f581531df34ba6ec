"""The process-wide ORT thread pool (`engines.ort.runner.use_shared_thread_pool`), which the `dspark-export` command
turns on. Each case runs in a subprocess: the pool is a once-per-process choice of ONNX Runtime's environment, and
this test process keeps per-session pools."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import TINY_BUILD



def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=500,
                          cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def int4_engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("shared-pool", **{**TINY_BUILD, "weights": "int4"})


def test_engines_share_one_pool_and_speculation_stays_exact(int4_engine_dir):
    """On the shared pool every engine session gives up threads of its own, the dspark.cpu kernels run on it, and
    greedy speculative output equals autoregressive output."""
    out = _run(f"""
        import json
        from dspark_export.engines.ort import runner
        runner.use_shared_thread_pool(2)
        runner.use_shared_thread_pool(1)          # keeps the first pool
        from dspark_export.runtime.api import Runtime
        from dspark_export.runtime.request import SamplingParams
        prompts = [[1, 5, 9, 13], [2, 7, 3, 3, 8, 21, 4]]
        tokens, per_session = {{}}, set()
        for policy in ("ar", "fixed:4", "dspark-async"):
            rt = Runtime.open({str(int4_engine_dir)!r}, policy=policy, threads=2)
            results = rt.generate_ids(prompts, [SamplingParams(max_new_tokens=24)] * 2)
            tokens[policy] = [r.token_ids for r in results]
            for r in rt.engines._runners.values():
                if r.session is not None:
                    per_session.add(r.session.get_session_options().use_per_session_threads)
        print(json.dumps({{"threads": runner.shared_thread_pool(),
                          "tokens": tokens, "per_session": sorted(per_session)}}))
    """)
    assert out["threads"] == 2
    assert out["per_session"] == [False]
    assert out["tokens"]["fixed:4"] == out["tokens"]["ar"] == out["tokens"]["dspark-async"]
    assert all(len(t) == 24 for t in out["tokens"]["ar"])


def test_sessions_made_before_keep_their_threads():
    """Sessions created before the pool keep their own threads and still run; ours made after are on the pool
    (ORT refuses a new session with threads of its own then); a pool another caller made is reused."""
    out = _run("""
        import json
        import numpy as np, onnx, onnxruntime as ort
        from dspark_export.engines.ort import runner
        graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                       [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                                       [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]).SerializeToString()
        session = lambda so: ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        before = session(runner.base_session_options(1))
        ort.set_global_thread_pool_sizes(2, 1)               # another caller's pool
        runner.use_shared_thread_pool(1)
        after = session(runner.base_session_options(1))
        x = {"x": np.array([-1.0, 2.0], np.float32)}
        print(json.dumps({"threads": runner.shared_thread_pool(),
                          "before": before.get_session_options().use_per_session_threads,
                          "after": after.get_session_options().use_per_session_threads,
                          "runs": [before.run(None, x)[0].tolist(), after.run(None, x)[0].tolist()]}))
    """)
    assert out == {"threads": 1, "before": True, "after": False, "runs": [[0.0, 2.0], [0.0, 2.0]]}


def test_the_command_runs_on_the_shared_pool(tiny_engine_dir):
    """`dspark-export` (console_main) turns the pool on for engine commands; `main` called in-process does not."""
    out = _run(f"""
        import json, sys
        from dspark_export import cli
        from dspark_export.engines.ort import runner
        rc_in_process = cli.main(["inspect", {str(tiny_engine_dir)!r}])
        before = runner.shared_thread_pool()
        sys.argv = ["dspark-export", "generate", "--engine-dir", {str(tiny_engine_dir)!r}, "--prompt", "hi",
                    "--max-new-tokens", "4"]
        rc = cli.console_main()
        print(json.dumps({{"rc": rc, "rc_in_process": rc_in_process, "before": before,
                          "after": runner.shared_thread_pool()}}))
    """)
    assert out == {"rc": 0, "rc_in_process": 0, "before": None, "after": 0}


@pytest.mark.parametrize("threads", [-1, 10**6, 1.5, True])
def test_bad_thread_counts_are_refused_before_anything_changes(threads):
    """A thread count outside 0..4 × cores is named and refused, and the process keeps per-session pools (this
    runs in the test process itself: nothing reaches ORT)."""
    from dspark_export.engines.ort import runner
    from dspark_export.errors import ConfigError

    with pytest.raises(ConfigError, match="threads: expected 0"):
        runner.use_shared_thread_pool(threads)
    assert runner.shared_thread_pool() is None


def test_the_command_names_a_bad_thread_count_in_one_line(tiny_engine_dir):
    """`dspark-export bench serve --threads -1`: one line naming threads, exit 2, and no pool (from a breaking
    pass: the pool was turned on outside main's error handling, so this was a traceback and exit 1)."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from dspark_export import cli; sys.exit(cli.console_main())",
                           "bench", "serve", "--engine-dir", str(tiny_engine_dir), "--threads", "-1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "threads: expected 0" in lines[0] and lines[0].startswith("dspark-export bench:")
