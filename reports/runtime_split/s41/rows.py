import numpy as np, sys
from dspark_export.engines.manifest import Manifest
from dspark_export.engines.engine_set import EngineSet
from dspark_export.engines.ort.runner import use_shared_thread_pool
from dspark_export.engines import profiler as P
use_shared_thread_pool(2)
m = Manifest.load(sys.argv[1]); es = EngineSet(m)
spec = m.data["graphs"]["target"]["spec"]
R = 4
items = {}
for n in [4, 5, 6, 8, 9, 10, 12, 14, 16]:
    base, extra = divmod(n, R)
    sizes = [base + (1 if i < extra else 0) for i in range(R)]
    feed = P._layout_feed(spec, sizes, R, 256, 200, n)
    runner = es.runner("target", n)
    items[n] = (runner, feed)
res = P.time_interleaved(items, 3, 30)
for n, r in res.items():
    print(n, es.bucket_for("target", n), {k: round(v, 3) for k, v in r.items() if k.endswith("ms")})
