"""Time the profiler's attention layouts with a given dspark.cpu library: python layouts.py ENGINE_DIR LIB.so"""
import sys, json
from pathlib import Path
from dspark_export.plugins import cpu_ops
lib = Path(sys.argv[2])
cpu_ops.library_path = lambda: lib
from dspark_export.engines import profiler
cpu_ops.RAGGED_ATTENTION = "none"   # the profiler then times the padded layouts anyway
from dspark_export.engines.engine_set import EngineSet
eng = EngineSet.open(Path(sys.argv[1]), threads=2)
res = profiler.measure_layout_cost(eng, 128, 2, 5)
print(lib.name, [(r['S'], r['Q'], r['P'], round(r['median_ms'], 2)) for r in res['layouts']])
