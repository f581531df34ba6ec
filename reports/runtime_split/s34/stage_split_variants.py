"""`stage_split.py` under an ORT thread variant: base (per-session pools), shared (`use_shared_thread_pool`),
globalall (the same through ORT directly), st (drafter block on one thread), spin / nospin, stop / stopall
(`session.force_spinning_stop` on the drafter block / also the target).

    python stage_split_variants.py VARIANT ENGINE_DIR POLICY[,POLICY...] [PROMPTS_PER_DATASET]"""
import sys, runpy
from dspark_export.engines.ort import runner as R
mode = sys.argv.pop(1)
if mode == 'st':
    R.SINGLE_THREAD_GRAPHS = R.SINGLE_THREAD_GRAPHS + ("drafter_block",)
elif mode == 'spin':
    orig = R.thread_settings
    R.thread_settings = lambda g, t=0: {**orig(g, t), "allow_spinning": g in ("target", "drafter_block")}
elif mode == 'nospin':
    orig = R.thread_settings
    R.thread_settings = lambda g, t=0: {**orig(g, t), "allow_spinning": False}
elif mode == 'shared':
    R.use_shared_thread_pool(2)
elif mode.startswith('stop'):
    origso = R.session_options
    def so_(overrides, threads=0, graph="target", prepack=False):
        so = origso(overrides, threads, graph, prepack)
        if graph == "drafter_block":
            so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        if graph in ("target", "drafter_block") and (mode == 'stopall' or graph == 'drafter_block'):
            so.add_session_config_entry("session.force_spinning_stop", "1")
        return so
    R.session_options = so_
elif mode.startswith('global'):
    import onnxruntime.capi._pybind_state as C
    C.set_global_thread_pool_sizes(2, 1)
    origso = R.session_options
    def so_(overrides, threads=0, graph="target", prepack=False):
        so = origso(overrides, threads, graph, prepack)
        if graph in ("target", "drafter_block") or mode == 'globalall':
            so.use_per_session_threads = False
        return so
    R.session_options = so_
sys.argv = ['solo_split.py'] + sys.argv[1:]
runpy.run_path(str(__import__('pathlib').Path(__file__).with_name('stage_split.py')), run_name='__main__')
