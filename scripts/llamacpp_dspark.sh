#!/usr/bin/env bash
# Interop check: run our shipped SmolLM2-135M-Instruct DSpark drafter inside llama.cpp's own DSpark
# speculative decoding (`--spec-type draft-dspark`), converted with llama.cpp's own converter.
#
# Stages (default: all, in order; pass a subset as arguments, e.g. `scripts/llamacpp_dspark.sh run`):
#   convert  drafter -> llama.cpp DSpark draft GGUF (convert_hf_to_gguf.py, vendored gguf-py), twice:
#            asis    = the checkpoint with only config.architectures renamed (see below);
#            qknorm1 = the same plus all-ones q_norm/k_norm tensors, the only way the unmodified llama.cpp
#                      loader accepts it. NOT the same network: llama.cpp's DFlash graph RMS-normalizes every
#                      Q/K head, our Llama-family drafter has no QK-norm (results are labelled as such).
#   build    llama-speculative-simple (speculative decoding) + llama-completion (plain baseline), CPU,
#            out of tree, ONE compile job (shared machine). AMX off: native AMX builds die with SIGILL here.
#   run      per prompt, interleaved, REPS times: plain, spec(asis), spec(qknorm1); greedy, THREADS threads,
#            draft length N_DRAFT (= the drafter's block size 7; llama.cpp's default is 3). On the unpatched
#            build spec(asis) stops at load ("tensor 'blk.0.attn_q_norm.weight' not found").
#   patch    optional (`scripts/llamacpp_dspark.sh patch run`): rebuild with QK-norm made optional in
#            llama.cpp's DFlash model (a 4-line source patch, applied to the vendored tree, built, reverted):
#            then spec(asis) is the faithful network on llama.cpp's DSpark loop, and spec(qknorm1) is
#            unchanged (its norm tensors exist, so it takes the unpatched code path).
#   d2t      optional, after `convert` and `patch`: the drafter with a reduced draft vocabulary (D2T_SIZE,
#            default 8192, llama.cpp's d2t path), then plain vs spec per prompt.
# Reports: reports/peers/llamacpp-dspark.md. Needs: cmake, ninja, a C++17 compiler, `pip install sentencepiece`
# (the converter imports it for Llama-family tokenizers even when no tokenizer.model exists).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
LLSRC=${LLSRC:-/tmp/llsrc/x/llama_cpp_python-0.3.36/vendor/llama.cpp}   # llama-cpp-python 0.3.36 sdist, vendor/
BUILD=${BUILD:-/tmp/llcpp-build}
WORK=${WORK:-/tmp/llspec}
TARGET_HF=${TARGET_HF:-$HOME/.cache/dspark-export/smollm2-135m-instruct}
TARGET_GGUF=${TARGET_GGUF:-$HOME/.cache/dspark-export/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}
DRAFTER=${DRAFTER:-$REPO/src/dspark_export/assets/drafters/smollm2-135m-instruct}
THREADS=${THREADS:-2}
N_PREDICT=${N_PREDICT:-128}
REPS=${REPS:-1}
N_DRAFT=${N_DRAFT:-7}
STAGES=("$@"); [ ${#STAGES[@]} -eq 0 ] && STAGES=(convert build run)

if [ ! -d "$LLSRC" ]; then
    echo "LLSRC=$LLSRC: no llama.cpp source; unpack the sdist: pip download --no-deps --no-binary :all:" \
         "llama-cpp-python==0.3.36 -d /tmp/llsrc && tar -xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc/x" >&2
    exit 2
fi
mkdir -p "$WORK"

convert() {
    # 1. the only edit the converter needs: our config says "LlamaDSparkModel", which llama.cpp does not
    #    register; "DSparkDraftModel" selects conversion/qwen.py DSparkModel (tokenizer from --target-model-dir).
    rm -rf "$WORK/drafter" "$WORK/drafter-qknorm1"
    cp -r "$DRAFTER" "$WORK/drafter"
    python - "$WORK/drafter/config.json" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["architectures"] = ["DSparkDraftModel"]
json.dump(cfg, open(sys.argv[1], "w"), indent=2)
EOF
    PYTHONPATH="$LLSRC/gguf-py" python "$LLSRC/convert_hf_to_gguf.py" "$WORK/drafter" \
        --target-model-dir "$TARGET_HF" --outfile "$WORK/draft-asis-f16.gguf" --outtype f16 > "$WORK/convert-asis.log" 2>&1
    # 2. the loader-compatible variant: identity-weight QK-norm tensors (llama.cpp requires them)
    cp -r "$WORK/drafter" "$WORK/drafter-qknorm1"
    python - "$WORK/drafter-qknorm1" <<'EOF'
import json, sys, torch
from safetensors.torch import load_file, save_file
folder = sys.argv[1]
cfg = json.load(open(f"{folder}/config.json"))
tensors = load_file(f"{folder}/model.safetensors")
for i in range(cfg["num_hidden_layers"]):
    for name in ("q_norm", "k_norm"):
        tensors[f"layers.{i}.self_attn.{name}.weight"] = torch.ones(cfg["head_dim"], dtype=torch.float16)
save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
EOF
    PYTHONPATH="$LLSRC/gguf-py" python "$LLSRC/convert_hf_to_gguf.py" "$WORK/drafter-qknorm1" \
        --target-model-dir "$TARGET_HF" --outfile "$WORK/draft-qknorm1-f16.gguf" --outtype f16 > "$WORK/convert-qknorm1.log" 2>&1
    PYTHONPATH="$LLSRC/gguf-py" python "$LLSRC/gguf-py/gguf/scripts/gguf_dump.py" --no-tensors "$WORK/draft-asis-f16.gguf" \
        | grep -E "dflash|mask_token" || true
}

build() {
    cmake -S "$LLSRC" -B "$BUILD" -G Ninja -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DCMAKE_BUILD_TYPE=Release
    cmake --build "$BUILD" --target llama-speculative-simple -j 1
    cmake --build "$BUILD" --target llama-completion -j 1
}

prompts() {
    # the first prompt of each default dataset of `bench peers`, with SmolLM2's chat template applied
    mkdir -p "$WORK/prompts"
    PYTHONPATH="$REPO/src" python - "$WORK/prompts" "$TARGET_HF" <<'EOF'
import sys
from transformers import AutoTokenizer
from dspark_export.datasets import default_datasets_dir, read_dataset
out, target = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(target)
for name in ("gsm8k", "humaneval", "mt-bench"):  # bench peers' default datasets, first row each
    prompt = read_dataset(default_datasets_dir() / f"{name}.jsonl")[0]
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    open(f"{out}/{name}.txt", "w").write(text)
EOF
}

plain() {  # $1 prompt file, $2 log
    "$BUILD/bin/llama-completion" -m "$TARGET_GGUF" -f "$1" -n "$N_PREDICT" -t "$THREADS" -c 2048 --temp 0 --top-k 1 \
        -no-cnv --no-warmup > "$2" 2>&1 || echo "plain: exit $?" >> "$2"
}

spec() {  # $1 draft gguf, $2 prompt file, $3 log
    "$BUILD/bin/llama-speculative-simple" -m "$TARGET_GGUF" -md "$1" --spec-type draft-dspark --spec-draft-n-max "$N_DRAFT" -f "$2" \
        -n "$N_PREDICT" -t "$THREADS" -td "$THREADS" -c 2048 --temp 0 --top-k 1 > "$3" 2>&1 || echo "spec: exit $?" >> "$3"
}

summary() {  # markdown table of the logs: decode speed and acceptance as llama.cpp prints them
    python - "$N_DRAFT" "$@" <<'EOF'
import re, sys
from pathlib import Path
n_draft = int(sys.argv[1])
print("| log | decode tokens/s | n_drafted | n_accept | accept % | tau ~ 1 + n_accept / (n_drafted / n_draft) |")
print("|---|---:|---:|---:|---:|---:|")
for f in sys.argv[2:]:
    text = Path(f).read_text(errors="replace")
    name = Path(f).stem
    def grab(pattern):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None
    if "not found" in text or "failed to initialize speculative" in text:
        miss = re.search(r"tensor '([^']+)' not found", text)
        print(f"| {name} | load failed: {miss.group(0) if miss else 'see log'} | | | | |")
        continue
    tps = grab(r"decoded +\d+ tokens in +[\d.]+ seconds, speed: +([\d.]+) t/s")
    if tps is None:  # llama-completion: decode-only timing
        tps = grab(r" eval time = +[\d.]+ ms / +\d+ runs .*?([\d.]+) tokens per second")
    drafted, accepted = grab(r"n_drafted = (\d+)"), grab(r"n_accept  = (\d+)")
    if drafted:
        tau = 1 + accepted / (drafted / n_draft)
        print(f"| {name} | {tps:.1f} | {drafted:.0f} | {accepted:.0f} | {100 * accepted / drafted:.1f} | {tau:.2f} |")
    else:
        print(f"| {name} | {tps:.1f} | | | | |")
EOF
}

run() {
    prompts
    local logs=()
    for rep in $(seq 1 "$REPS"); do
        for p in "$WORK"/prompts/*.txt; do
            local n; n=$(basename "$p" .txt)
            plain "$p" "$WORK/run-$n-r$rep-plain.log"; logs+=("$WORK/run-$n-r$rep-plain.log")
            spec "$WORK/draft-asis-f16.gguf" "$p" "$WORK/run-$n-r$rep-asis.log"; logs+=("$WORK/run-$n-r$rep-asis.log")
            spec "$WORK/draft-qknorm1-f16.gguf" "$p" "$WORK/run-$n-r$rep-qknorm1.log"; logs+=("$WORK/run-$n-r$rep-qknorm1.log")
        done
    done
    summary "${logs[@]}"
}

patch() {
    # make attn_q_norm/attn_k_norm optional in llama.cpp's DFlash model and skip the per-head RMS norm when
    # absent (what a Llama-family DSpark drafter needs); reverted after the runs so the tree stays pristine
    local f="$LLSRC/src/models/dflash.cpp"
    cp "$f" "$WORK/dflash.cpp.orig"
    python - "$f" <<'EOF'
import sys
path = sys.argv[1]
src = open(path).read()
edits = [
    ('layer.attn_q_norm = create_tensor(tn(LLM_TENSOR_ATTN_Q_NORM, "weight", i), { n_embd_head_k }, 0);',
     'layer.attn_q_norm = create_tensor(tn(LLM_TENSOR_ATTN_Q_NORM, "weight", i), { n_embd_head_k }, TENSOR_NOT_REQUIRED);'),
    ('layer.attn_k_norm = create_tensor(tn(LLM_TENSOR_ATTN_K_NORM, "weight", i), { n_embd_head_k }, 0);',
     'layer.attn_k_norm = create_tensor(tn(LLM_TENSOR_ATTN_K_NORM, "weight", i), { n_embd_head_k }, TENSOR_NOT_REQUIRED);'),
    ('            Kcur = build_norm(Kcur, layer.attn_k_norm, NULL, LLM_NORM_RMS, il);\n            if (shared_kv)',
     '            if (layer.attn_k_norm) Kcur = build_norm(Kcur, layer.attn_k_norm, NULL, LLM_NORM_RMS, il);\n            if (shared_kv)'),
    ('        Qcur = build_norm(Qcur, layer.attn_q_norm, NULL, LLM_NORM_RMS, il);\n        Kcur = build_norm(Kcur, layer.attn_k_norm, NULL, LLM_NORM_RMS, il);',
     '        if (layer.attn_q_norm) Qcur = build_norm(Qcur, layer.attn_q_norm, NULL, LLM_NORM_RMS, il);\n        if (layer.attn_k_norm) Kcur = build_norm(Kcur, layer.attn_k_norm, NULL, LLM_NORM_RMS, il);'),
]
for old, new in edits:
    if src.count(old) != 1:
        sys.exit(f"{path}: expected exactly one occurrence of {old!r}; this llama.cpp differs from the one patched here")
    src = src.replace(old, new)
open(path, "w").write(src)
EOF
    diff -u "$WORK/dflash.cpp.orig" "$f" > "$WORK/dflash-optional-qknorm.patch" || true
    cmake --build "$BUILD" --target llama-speculative-simple -j 1 || { cp "$WORK/dflash.cpp.orig" "$f"; exit 1; }
    cp "$WORK/dflash.cpp.orig" "$f"
}

d2t() {
    # reduced draft vocabulary through llama.cpp's d2t path: draft_vocab_size = D2T_SIZE, d2t from our
    # draft_vocab.json ranking (training.draft_vocab.select_d2t, as the exporter does), stored as offsets
    # (d2t[i] = target_id - i, which convert_hf_to_gguf.py turns back into ids), markov_w2 rows and an
    # lm_head sliced to those ids (SmolLM2 ties lm_head to embed_tokens); markov_w1 stays full-vocabulary.
    rm -rf "$WORK/drafter-d2t"
    cp -r "$WORK/drafter" "$WORK/drafter-d2t"
    PYTHONPATH="$REPO/src" python - "$WORK/drafter-d2t" "$TARGET_HF" "${D2T_SIZE:-8192}" <<'EOF'
import json, sys
import numpy as np, torch
from safetensors.torch import load_file, save_file
from dspark_export.training.draft_vocab import select_d2t
folder, target, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = json.load(open(f"{folder}/config.json"))
tcfg = json.load(open(f"{target}/config.json"))
ranking = np.asarray(json.load(open(f"{folder}/draft_vocab.json"))["ranking"], np.int64)
ids = torch.from_numpy(select_d2t(ranking, size, cfg["vocab_size"]))
tensors = load_file(f"{folder}/model.safetensors")
tgt = load_file(f"{target}/model.safetensors")
head = tgt["model.embed_tokens.weight"] if tcfg.get("tie_word_embeddings") else tgt["lm_head.weight"]
tensors["markov_head.markov_w2.weight"] = tensors["markov_head.markov_w2.weight"][ids].contiguous()
tensors["lm_head.weight"] = head[ids].to(torch.float16).contiguous()
tensors["d2t"] = ids - torch.arange(size, dtype=torch.int64)
save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
cfg["draft_vocab_size"] = size
json.dump(cfg, open(f"{folder}/config.json", "w"), indent=2)
EOF
    PYTHONPATH="$LLSRC/gguf-py" python "$LLSRC/convert_hf_to_gguf.py" "$WORK/drafter-d2t" \
        --target-model-dir "$TARGET_HF" --outfile "$WORK/draft-d2t-f16.gguf" --outtype f16 > "$WORK/convert-d2t.log" 2>&1
    prompts
    local logs=()
    for rep in $(seq 1 "$REPS"); do
        for p in "$WORK"/prompts/*.txt; do
            local n; n=$(basename "$p" .txt)
            plain "$p" "$WORK/d2t-$n-r$rep-plain.log"; logs+=("$WORK/d2t-$n-r$rep-plain.log")
            spec "$WORK/draft-d2t-f16.gguf" "$p" "$WORK/d2t-$n-r$rep-d2t.log"; logs+=("$WORK/d2t-$n-r$rep-d2t.log")
        done
    done
    summary "${logs[@]}"
}

for stage in "${STAGES[@]}"; do
    case "$stage" in
        convert|build|run|patch|d2t) "$stage" ;;
        *) echo "unknown stage '$stage': expected convert, build, run, patch or d2t" >&2; exit 2 ;;
    esac
done
