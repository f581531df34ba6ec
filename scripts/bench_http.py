"""HTTP load benchmark (same as `dspark-export bench http`): closed-loop clients against `dspark-export serve`
vs the in-process Service, interleaved. See src/dspark_export/bench/http.py."""

import argparse
import sys
import time

from dspark_export.bench import http_cli

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, epilog=http_cli.EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    http_cli.add_arguments(parser)
    t0 = time.perf_counter()
    print(http_cli.run(parser.parse_args(), lambda m: print(f"[{time.perf_counter() - t0:7.1f}s] {m}",
                                                            file=sys.stderr, flush=True)))
