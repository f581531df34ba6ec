import sys, time
from dspark_export.runtime import kv_cache as K
from dspark_export.bench import serve as S
log = []
for name in ("_allocate", "remap"):
    orig = getattr(K.KVCache, name)
    def f(self, *a, _o=orig, _n=name):
        t = time.perf_counter(); _o(self, *a)
        log.append((self.num_layers, self.num_slots, self.capacity, _n, round((time.perf_counter() - t) * 1e3, 1)))
    setattr(K.KVCache, name, f)
ol = S._closed_loop
def loop(*a):
    log.clear(); t = time.perf_counter(); r = ol(*a)
    print(f"run {time.perf_counter() - t:.2f} s; target reallocations {[x for x in log if x[0] > 2]}; total {sum(x[4] for x in log):.0f} ms")
    return r
S._closed_loop = loop
cfg = S.ServeBenchConfig(sys.argv[1], concurrency=(int(sys.argv[2]),), policies=("ar",), repeats=3, requests=32,
                         max_new_tokens=64, threads=2, datasets_dir="/work/shared/eval_datasets", identity_checks=0)
S.run_serve_bench(cfg, progress=lambda s: None)
