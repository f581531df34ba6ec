"""A closed loop of C requests in a toy cost model, read by `bench serve`'s window (first submission to the
first completion that cannot be replaced) three ways: tokens / time ("ratio", the old reading), the
least-squares slope of tokens against time (`bench.serve.steady_rate`) and tokens / time to the last
completion ("makespan"). "sync": every request commits one token a step, so requests that start together
finish together (ar at equal lengths); "desync": 1-3 tokens a step at random (speculation), so they drift
apart. Each reading over the true long-run rate (a 4,000-request run), mean and spread over 40 seeds.

Step cost (ms): 5.5 + 0.5 a decode row (+0.3 ms and 0.6 of a row per extra token for desync) + 0.44 a prompt
token; prompts 60-200 tokens; 64 new tokens.

    python reports/serve/window-bias/sim.py
"""
import numpy as np
def run(policy, C, N, seed, T=64):
    rng = np.random.default_rng(seed)
    plen = rng.integers(60, 200, size=N)
    a, b, p = 5.5, 0.5, 0.44          # ms: per step, per decode row, per prompt token
    reqs = []  # [remaining tokens, prefilled?]
    sub = 0
    def submit():
        nonlocal sub
        reqs.append([T, False, plen[sub]]); sub += 1
    for _ in range(C): submit()
    t = 0.0; tok = 0; pts = [(0.0, 0)]; steady = True; win_t = None; win_tok = None; done = 0
    while reqs:
        cost = a; new = 0
        for r in reqs:
            if not r[1]:
                cost += p * r[2]; r[1] = True; r[0] -= 1; new += 1
            else:
                if policy == "sync":
                    k = 1; cost += b
                else:
                    k = int(rng.choice([1, 2, 3], p=[0.55, 0.3, 0.15])); cost += b * (1 + 0.6 * (k - 1))  + 0.3
                k = min(k, r[0]); r[0] -= k; new += k
        t += cost; tok += new
        fin = [r for r in reqs if r[0] <= 0]
        for r in fin: reqs.remove(r)
        if steady: pts.append((t, tok))
        for r in fin:
            done += 1
            if sub < N: submit()
            elif steady: steady = False
    P = np.array(pts)
    ratio = P[-1, 1] / P[-1, 0]
    slope = np.polyfit(P[:, 0], P[:, 1], 1)[0]
    return ratio, slope, tok / t
for pol in ("sync", "desync"):
    for C in (4,):
        true = np.mean([run(pol, C, 4000, s)[0] for s in range(2)])
        for N in (16, 32, 64, 96):
            R = np.array([run(pol, C, N, 100 + s)[:3] for s in range(40)])
            print(pol, C, N, "true %.4f" % true, "ratio %.4f slope %.4f makespan %.4f" % tuple(R.mean(0) / true), "sd ratio %.4f slope %.4f" % tuple(R.std(0)[:2] / true))
