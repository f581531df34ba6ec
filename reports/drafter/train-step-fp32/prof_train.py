"""Drafter training steps on a feature cache (v3 config: γ 5, 2 layers, Markov rank 32, N 8192, 4 seqs × 64 anchors,
warm start from the shipped drafter): usage `prof_train.py THREADS bf16|fp32 [FEATURES_DIR] [--profile]`;
the median of 6 steps after 2 warm-up steps, and with --profile a torch.profiler table of 3 more."""
import sys, time, json
import numpy as np, torch
from pathlib import Path
from dspark_export.modeling.target import default_target_path, load_target
from dspark_export.training.features import FeatureCache
from dspark_export.training.trainer import TrainConfig, drafter_config_for, _warm_start
from dspark_export.training.objective import make_batch, dspark_loss, target_logsumexp
from dspark_export.training.draft_vocab import load_draft_vocab_source, select_d2t
from dspark_export.modeling.drafter import init_drafter
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
bf16 = (sys.argv[2] != "fp32") if len(sys.argv) > 2 else True
torch.set_num_threads(threads)
A = str(Path(__file__).resolve().parents[3] / "src/dspark_export/assets/drafters/smollm2-135m-instruct")
target = load_target(default_target_path())
cfg = TrainConfig(out_dir="/tmp/trainprof", num_draft_layers=2, markov_rank=32, block_size=5, draft_vocab=8192, init_from=A, bf16=bf16)
dcfg = drafter_config_for(target, cfg)
drafter = init_drafter(target, dcfg, seed=0).train()
_warm_start(drafter, target, Path(A))
ranking = load_draft_vocab_source(Path(A) / "draft_vocab.json", dcfg.vocab_size, target.eos_token_ids)
d2t = torch.as_tensor(np.asarray(select_d2t(ranking["ranking"], 8192, dcfg.vocab_size)), dtype=torch.long)
cache = FeatureCache(sys.argv[3] if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else "/tmp/s17/run/features/train")
params = [p for p in drafter.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4)
rng = np.random.default_rng(0)
W = drafter.lm_head.weight.detach()
seqs_all = []
for i in range(len(cache)):
    s = cache[i]; s.t_lse = target_logsumexp(torch.from_numpy(s.last), W, bf16=bf16).numpy(); seqs_all.append(s)
def step():
    picks = rng.choice(len(seqs_all), size=4, replace=False)
    batch = make_batch([seqs_all[i] for i in picks], 64, 5, rng)
    loss, m = dspark_loss(drafter, batch, cfg.loss, bf16=bf16, d2t=d2t)
    opt.zero_grad(set_to_none=True); loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step()
for _ in range(2): step()
t = []
for _ in range(6):
    t0 = time.perf_counter(); step(); t.append(time.perf_counter() - t0)
print(f"threads {threads} bf16 {bf16}: step median {np.median(t):.3f} s, all {[round(x, 2) for x in t]}")
if "--profile" in sys.argv:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3): step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
