"""`../s34/stage_split.py` on the shared ORT pool (2 threads), here run on the mt-bench prompts alone: per policy
tokens/s, rounds, τ, host time and each engine's calls / mean ms, two rounds alternating the policies.

    python stage_split_mt.py ENGINE_DIR POLICY[,POLICY...] PROMPTS_PER_DATASET DATASET[,DATASET...]
"""
import runpy
import sys
from pathlib import Path

from dspark_export.engines.ort.runner import use_shared_thread_pool

use_shared_thread_pool(2)
sys.argv = ["stage_split.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).parent.parent / "s34" / "stage_split.py"), run_name="__main__")
