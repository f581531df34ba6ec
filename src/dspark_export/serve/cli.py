"""Command-line glue of `dspark-export serve` (one uvicorn replica, or N Ray Serve replicas) and of
`dspark-export bench http` (serve/bench.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..runtime import DEFAULT_POLICY

EXAMPLES = """examples:
  dspark-export serve --engine-dir engines/smollm2                      # http://127.0.0.1:8000/v1
  DSPARK_API_KEY=secret dspark-export serve --engine-dir engines/smollm2 --host 0.0.0.0 --port 8080
  dspark-export serve --engine-dir engines/smollm2 --replicas 2         # Ray Serve, a local Ray instance
  curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is 12*7?"}], "max_tokens": 32}'
"""


BENCH_EXAMPLES = """examples:
  dspark-export bench http --engine-dir engines/smollm2 --concurrency 1,2,4,8,16 --out-dir reports/http
  dspark-export bench http --engine-dir engines/smollm2 --concurrency 1,4 --requests 8 --repeats 1 --json http.json
"""


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {value}")
        return value
    parse.__name__ = name
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-dir", required=True, type=Path, help="an engine directory made by `build`")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1, loopback only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (8000)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"default verification policy: ar | fixed:K | threshold:C | dspark | dspark-async ({DEFAULT_POLICY}); "
                        "a request may name its own with the `policy` field")
    p.add_argument("--model-name", default=None, help="model id clients send (default: the engine directory's name)")
    p.add_argument("--api-key", default=None,
                   help="bearer key required on /v1/* (default: the DSPARK_API_KEY environment variable; none if unset)")
    p.add_argument("--max-body-bytes", type=_positive("bytes"), default=1 << 20,
                   help="request bodies above this get 413 (1048576)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a KV-cache slot; more in flight get 429 (64)")
    p.add_argument("--max-slots", type=_positive("slots"), default=None,
                   help="requests decoded at once (default: the largest drafter bucket)")
    p.add_argument("--kv-prefault-tokens", type=int, default=0, metavar="TOKENS",
                   help="at startup, write the KV cache memory once for --max-slots requests of TOKENS tokens (prompt "
                        "+ output), so no request pays the first touch of its pages while the cache grows (slow on "
                        "some VMs: ~150 MB/s); costs that memory up front, as vLLM's KV cache does (0 = off)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads per replica (0 = its choice)")
    p.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime", help="engines to run")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the engine files")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish (30)")
    p.add_argument("--replicas", type=_positive("replicas"), default=1,
                   help="N > 1: N replicas as a Ray Serve deployment (needs the ray[serve] extra)")
    p.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (default with --replicas > 1: start a local Ray instance)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (1)")
    p.add_argument("--debug-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: slow steps down


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code.

    Raises:
        ConfigError: a bad flag (named), or Ray missing for --replicas > 1.
    """
    from .app import ServeConfig

    if args.kv_prefault_tokens < 0:
        raise ConfigError(f"--kv-prefault-tokens: expected an integer >= 0 (0 = off), found {args.kv_prefault_tokens}")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue: expected an integer >= 0, found {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: expected 0..65535, found {args.port}")
    if not args.engine_dir.is_dir():
        raise ConfigError(f"--engine-dir: {args.engine_dir} is not a directory (expected one made by `build`)")
    from ..runtime.policies import parse_policy

    parse_policy(args.policy)
    config = ServeConfig(engine_dir=str(args.engine_dir.resolve()), policy=args.policy, model_name=args.model_name,
                         api_key=args.api_key if args.api_key is not None else os.environ.get("DSPARK_API_KEY", ""),
                         max_body_bytes=args.max_body_bytes, max_queue=args.max_queue, max_slots=args.max_slots,
                         kv_prefault_tokens=args.kv_prefault_tokens,
                         threads=args.threads, backend=args.backend, verify=not args.no_verify,
                         debug_step_delay_s=args.debug_step_delay)
    if args.replicas > 1 or args.ray_address:
        from .ray_deploy import serve_on_ray

        return serve_on_ray(config, replicas=args.replicas, host=args.host, port=args.port,
                            ray_address=args.ray_address, replica_cpus=args.replica_cpus, progress=progress)
    from .server import serve_forever

    progress(f"serving {config.served_model} on http://{args.host}:{args.port}/v1 (loading {args.engine_dir})")
    return serve_forever(config, host=args.host, port=args.port, drain_s=args.drain_seconds)


# -- `dspark-export bench http` (serve/bench.py) ---------------------------------------------------
def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.common import csv_list, int_list

    p.add_argument("--engine-dir", required=True, help="a built engine directory")
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16],
                   help="comma-separated closed-loop client counts C (default 1,2,4,8,16)")
    p.add_argument("--requests", type=int, default=None, help="completed requests per run (default max(4, C))")
    p.add_argument("--datasets", type=csv_list, default=["gsm8k", "mt-bench"],
                   help="comma-separated dataset names (default gsm8k,mt-bench)")
    p.add_argument("--datasets-dir", default=None, help="folder of <name>.jsonl files (default ../shared/eval_datasets)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"verification policy of both modes (default {DEFAULT_POLICY})")
    p.add_argument("--repeats", type=int, default=2, help="runs per (mode, C), modes interleaved (default 2)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads of each engine (0 = its choice)")
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up")
    p.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--out-dir", type=Path, default=None, help="write JSON and markdown here")


def run_bench(args: argparse.Namespace, progress: Callable[[str], None]) -> str:
    """Run `bench http` from parsed flags; writes --json / --out-dir; returns the markdown table."""
    from ..bench.common import write_outputs
    from .bench import HttpBenchConfig, markdown_table, run_http_bench, write_reports

    cfg = HttpBenchConfig(engine_dir=args.engine_dir, concurrency=tuple(args.concurrency), requests=args.requests,
                          datasets=tuple(args.datasets), datasets_dir=args.datasets_dir,
                          max_new_tokens=args.max_new_tokens, policy=args.policy, repeats=args.repeats,
                          threads=args.threads, warmup=not args.no_warmup)
    result = run_http_bench(cfg, progress)
    write_outputs(result, args, write_reports, progress)
    return markdown_table(result)
