"""`bench serve` at C = 8, 16 (ar, dspark-async, 2 repeats, 32 requests × 64 tokens) with whatever
dspark_export is importable: run it once on the change and once with PYTHONPATH=<worktree of the parent>/src.
Usage: python serve_ab.py ENGINE_DIR"""
import sys

from dspark_export.bench import serve as S

cfg = S.ServeBenchConfig(sys.argv[1], concurrency=(8, 16), policies=("ar", "dspark-async"), repeats=2, requests=32,
                         max_new_tokens=64, threads=2, datasets_dir="/work/shared/eval_datasets")
print(S.markdown_table(S.run_serve_bench(cfg, progress=lambda s: None)))
