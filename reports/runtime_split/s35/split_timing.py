"""What the split scripts of this folder share: `wrap(cls, name)` makes each call of that method add its wall
time (s) to T[key] and 1 to N[key] (key "Class.method" unless given); `wrap_infer()` does the same for every
engine call, keyed "infer.<graph>"."""
import collections
import time

from dspark_export.runtime import stages as ST

T: collections.defaultdict = collections.defaultdict(float)
N: collections.Counter = collections.Counter()


def wrap(cls, name, key=None):
    orig, key = getattr(cls, name), key or f"{cls.__name__}.{name}"

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            T[key] += time.perf_counter() - t
            N[key] += 1
    setattr(cls, name, timed)


def wrap_infer():
    orig = ST.EngineStages.infer

    def infer(self, runner, feed):
        t = time.perf_counter()
        try:
            return orig(self, runner, feed)
        finally:
            key = "infer." + runner.key.graph
            T[key] += time.perf_counter() - t
            N[key] += 1
    ST.EngineStages.infer = infer
