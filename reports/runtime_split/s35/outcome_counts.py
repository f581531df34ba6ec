"""Per prompt of the peer benchmark (21, 128 new tokens), dspark-async on one Generator across prompts: steps,
drafted and skipped steps, drafts verified (Σℓ), the survivals their confidences promised (pred) against the
drafts accepted, the mean first-position survival and first-draft acceptance. Counts only: no timing.

    python reports/runtime_split/s35/outcome_counts.py ENGINE_DIR [hold]    # hold: outcome_ratio held at 1
"""
import sys, numpy as np
from dspark_export.bench.peers import PeersBenchConfig
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.runtime.scheduler import survival_probs
E = sys.argv[1]; policy = "dspark-async"
if len(sys.argv) > 2 and sys.argv[2] == "hold":
    from dspark_export.runtime.draft_control import SkipController
    SkipController.outcome_ratio = lambda self: 1.0
prompts = PeersBenchConfig(E, datasets=("gsm8k", "humaneval", "mt-bench"), datasets_dir="/work/shared/eval_datasets",
                           prompts_per_dataset=7).prompts
rt = Runtime.open(E, policy="ar", threads=1)
gen = Generator(rt.engines, parse_policy(policy))
log = []
orig = Generator._apply
def apply(self, rnd):
    if rnd.conf is not None and rnd.drafts is not None:
        for s in rnd.drafted:
            l = int(rnd.verify_lens[s.slot]); a = int(rnd.num_accepted[s.slot])
            surv = survival_probs(rnd.drafts["confidence"][[s.slot]])[0]
            log.append(("d", l, float(surv[:l].sum()), a, surv))
    else:
        log.append(("s",))
    orig(self, rnd)
Generator._apply = apply
for i, q in enumerate(prompts):
    log.clear()
    ids = rt.encode(q, True)
    [r] = gen.generate([ids], [SamplingParams(max_new_tokens=128)])
    d = [x for x in log if x[0] == "d"]; s = [x for x in log if x[0] == "s"]
    ver = [x for x in d if x[1] > 0]
    pred = sum(x[2] for x in ver); real = sum(x[3] for x in ver)
    s1 = np.mean([x[4][0] for x in d]) if d else float("nan")
    a1 = np.mean([x[3] >= 1 for x in ver]) if ver else float("nan")
    print(f"{i:2d} steps {len(log):3d} drafted {len(d):3d} verified>0 {len(ver):3d} skipped {len(s):3d} "
          f"Σℓ {sum(x[1] for x in ver):4d} pred {pred:6.1f} accepted {real:4d} ratio {real / max(pred, 1e-9):.2f} "
          f"surv1 {s1:.2f} acc1 {a1:.2f}", flush=True)
