"""HTTP load benchmark (same as `dspark-export bench http`): closed-loop clients against `dspark-export serve`
vs the in-process Service, interleaved. See src/dspark_export/serve/bench.py."""

import argparse
import sys
import time

from dspark_export.serve import cli as serve_cli

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, epilog=serve_cli.BENCH_EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_cli.add_bench_arguments(parser)
    t0 = time.perf_counter()
    print(serve_cli.run_bench(parser.parse_args(), lambda m: print(f"[{time.perf_counter() - t0:7.1f}s] {m}",
                                                            file=sys.stderr, flush=True)))
