"""Share of response positions whose target argmax (from the cached final hidden, through the shared head) differs
from the record's next token, by the record's sampling temperature (every STRIDE-th of the cached sequences).

    python label_diff.py FEATURES_DIR STRIDE [int4]   # the default target's head, float32 or int4-dequantized
"""
import sys, collections
import numpy as np, torch
from dspark_export.modeling.target import default_target_path, load_target
from dspark_export.training.features import FeatureCache
from dspark_export.training.objective import response_targets
torch.set_num_threads(1)
cache = FeatureCache(sys.argv[1]); stride = int(sys.argv[2])
W = load_target(default_target_path()).model.get_output_embeddings().weight.detach().float()
if len(sys.argv) > 3 and sys.argv[3] == "int4":   # the int4 engine's head: MatMulNBits blocks, dequantized
    from dspark_export.exporter.quantize import WeightFormat, dequantize_blocks, quantize_blocks
    fmt = WeightFormat("int4")
    W = torch.from_numpy(dequantize_blocks(*quantize_blocks(W.numpy().T, fmt), fmt, W.shape[1]).T.copy())
diff, n = collections.Counter(), collections.Counter()
for i in range(0, len(cache), stride):
    s = cache[i]; T = len(s.tokens); p = s.prompt_len
    if T - p < 2: continue
    _, top = response_targets(s, W)
    d = top[p:T - 1] != s.tokens[p + 1:T]
    key = s.source.get("temperature"); diff[key] += int(d.sum()); n[key] += len(d)
for k in sorted(n): print(f"temperature {k}: {diff[k]}/{n[k]} positions ({100*diff[k]/n[k]:.1f} %) argmax != token")
