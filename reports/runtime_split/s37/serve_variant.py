"""`dspark-export` (the CLI's main, shared ORT pool) with dspark_export.runtime.draft_control constants overridden.

    python reports/runtime_split/s37/serve_variant.py NAME=VALUE [...] -- bench serve ...
"""
import sys
from dspark_export.runtime import draft_control as DC
args = sys.argv[1:]
i = args.index("--")
for kv in args[:i]:
    k, v = kv.split("="); setattr(DC, k, type(getattr(DC, k))(float(v)) if not isinstance(getattr(DC, k), int) else int(float(v)))
from dspark_export.cli import main
sys.exit(main(args[i + 1:], shared_thread_pool=True))
