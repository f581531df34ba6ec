"""Steady-state training step time of the ablation's arms, interleaved: `step_times.py FEATURES_DIR [ROUNDS]`.

Arms (from scratch, γ 5, 2 layers, Markov rank 32, 4 sequences × 64 anchors, fp32, 2 threads): DSpark over the
draft vocabulary N 8192, DSpark over the full vocabulary, DFlash over N 8192. The target's logsumexp each
N-vocabulary sequence needs is computed before timing (the trainer memoizes it once per sequence; its cost is
reported separately, per token). Prints one JSON line: median step seconds per arm, all rounds, lse ms/token.
"""
import json
import sys
import time

import numpy as np
import torch

from dspark_export.modeling.drafter import init_drafter
from dspark_export.modeling.target import default_target_path, load_target
from dspark_export.training.draft_vocab import load_draft_vocab_source, select_d2t
from dspark_export.training.features import FeatureCache
from dspark_export.training.objective import dspark_loss, make_batch, target_logsumexp
from dspark_export.training.trainer import TrainConfig, drafter_config_for

torch.set_num_threads(2)
cache = FeatureCache(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
target = load_target(default_target_path())
ranking = load_draft_vocab_source(sys.argv[3] if len(sys.argv) > 3 else
                                  "src/dspark_export/assets/drafters/smollm2-135m-instruct/draft_vocab.json",
                                  target.config.vocab_size, target.eos_token_ids)
d2t = torch.as_tensor(np.asarray(select_d2t(ranking["ranking"], 8192, target.config.vocab_size)), dtype=torch.long)
seqs = [cache[i] for i in range(min(len(cache), 64))]
arms = {}
for name, variant, n in (("dspark-n8192", "dspark", 8192), ("dspark-full", "dspark", None), ("dflash-n8192", "dflash", 8192)):
    cfg = TrainConfig(out_dir="/tmp/steptimes", variant=variant, num_draft_layers=2, markov_rank=32, block_size=5,
                      draft_vocab=n)
    drafter = init_drafter(target, drafter_config_for(target, cfg), seed=0).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    arms[name] = (cfg, drafter, params, torch.optim.AdamW(params, lr=1e-4), None if n is None else d2t)
W = arms["dspark-n8192"][1].lm_head.weight.detach()
t0, tokens = time.perf_counter(), 0
for s in seqs:
    s.t_lse = target_logsumexp(torch.from_numpy(s.last), W).numpy()
    tokens += len(s.tokens)
lse_ms_per_token = 1e3 * (time.perf_counter() - t0) / tokens
rng = np.random.default_rng(0)


def step(name):
    cfg, drafter, params, opt, arm_d2t = arms[name]
    batch = make_batch([seqs[i] for i in rng.choice(len(seqs), size=4, replace=False)], 64, 5, rng)
    loss, _ = dspark_loss(drafter, batch, cfg.loss, d2t=arm_d2t)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


times = {name: [] for name in arms}
for r in range(rounds + 2):
    for name in (list(arms) if r % 2 else list(arms)[::-1]):
        t0 = time.perf_counter()
        step(name)
        if r >= 2:
            times[name].append(time.perf_counter() - t0)
print(json.dumps({"step_s_median": {k: round(float(np.median(v)), 3) for k, v in times.items()},
                  "step_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                  "lse_ms_per_token": round(lse_ms_per_token, 3), "sequences": len(seqs), "tokens": tokens}))
