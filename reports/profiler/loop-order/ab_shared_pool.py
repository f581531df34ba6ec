import os, sys, runpy
from dspark_export.engines.ort.runner import use_shared_thread_pool
use_shared_thread_pool(2)
if "MARGIN" in os.environ:
    from dspark_export.runtime import draft_control as DC
    DC._SKIP_MARGIN = float(os.environ["MARGIN"])
sys.argv = ["ab_drafters.py"] + sys.argv[1:]
runpy.run_path("scripts/ab_drafters.py", run_name="__main__")
