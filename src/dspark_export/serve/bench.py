"""HTTP load benchmark: closed-loop clients against `dspark-export serve`, against the in-process `Service`.

At each concurrency C, C clients each send a request, wait for its last token, and send the next
(closed loop) until `requests` have completed. The same prompts run two ways, interleaved per
repeat (the order alternates between repeats):

- "http": a `dspark-export serve` subprocess on a free loopback port; the clients stream chat
  completions (SSE, include_usage) with an async HTTP client in this process;
- "inproc": the same engine directory opened in this process, the same `Service` and driver thread
  the server uses (`serve.engine.AsyncEngine`), requests submitted directly (no HTTP, no JSON).

Per run: time to first token (TTFT, first non-empty text), time per output token after the first
((last - first) / (tokens - 1), the inter-token latency a streaming client sees), completion tokens per
second over the run's wall time. HTTP overhead = 1 - throughput(http) / throughput(inproc), paired per
repeat. The load clients run on the same cores as the engine (both modes), so the numbers include
their CPU cost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import ConfigError
from ..bench.common import check_datasets, check_engine_dir
from ..runtime import DEFAULT_POLICY
from ..datasets import read_dataset

__all__ = ["HttpBenchConfig", "run_http_bench", "markdown_table", "write_reports"]


@dataclass
class HttpBenchConfig:
    engine_dir: str | Path
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests: int | None = None          # completed requests per run (default max(4, C))
    datasets: tuple[str, ...] = ("gsm8k", "mt-bench")
    datasets_dir: str | Path | None = None
    max_new_tokens: int = 48
    policy: str = DEFAULT_POLICY
    repeats: int = 2
    threads: int = 0
    warmup: bool = True
    seed: int = 0
    server_start_timeout_s: float = 300.0
    extra: dict = field(default_factory=dict)


@dataclass
class _Sample:
    ttft: float
    tpot: float | None
    tokens: int


def _prompts(cfg: HttpBenchConfig, n: int, runtime) -> list[str]:
    """The first `n` prompts, datasets round-robin in a seeded order, whose chat-encoded length leaves
    room for max_new_tokens in the engine's context."""
    names, root = check_datasets(cfg.datasets, cfg.datasets_dir)
    limit = int(runtime.engines.manifest.runtime["max_context"]) - cfg.max_new_tokens
    pools = []
    for i, name in enumerate(names):
        texts = read_dataset(Path(root) / f"{name}.jsonl")
        pools.append([texts[j] for j in np.random.default_rng([cfg.seed, i]).permutation(len(texts))])
    out = []
    for k in range(max(len(p) for p in pools) * len(pools)):
        pool = pools[k % len(pools)]
        if k // len(pools) < len(pool) and len(runtime.encode(pool[k // len(pools)], True)) <= limit:
            out.append(pool[k // len(pools)])
            if len(out) == n:
                return out
    raise ConfigError(f"datasets {list(names)}: only {len(out)} prompts fit the engine's context with "
                      f"max_new_tokens {cfg.max_new_tokens}; {n} needed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _closed_loop(one, prompts: list[str], concurrency: int) -> tuple[list[_Sample], float]:
    queue = list(enumerate(prompts))
    samples: list[_Sample] = []

    async def worker():
        while queue:
            _, text = queue.pop(0)
            samples.append(await one(text))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


def _sample(t0: float, times: list[float], tokens: int) -> _Sample:
    first = times[0] if times else time.perf_counter()
    tpot = (times[-1] - first) / (tokens - 1) if tokens > 1 and len(times) > 1 else None
    return _Sample(first - t0, tpot, tokens)


async def _http_run(base: str, model: str, prompts: list[str], c: int, max_tokens: int):
    import httpx2 as httpx

    limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        async def one(text: str) -> _Sample:
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            t0, times, tokens = time.perf_counter(), [], 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise ConfigError(f"bench http: the server answered {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        if choice["delta"].get("content"):
                            times.append(time.perf_counter())
            return _sample(t0, times, tokens)

        return await _closed_loop(one, prompts, c)


async def _inproc_run(engine, runtime, prompts: list[str], c: int, max_tokens: int):
    from ..runtime.request import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens)

    async def one(text: str) -> _Sample:
        t0, times, tokens = time.perf_counter(), [], 0
        _, queue = engine.submit(runtime.encode(text, True), params, None)
        while True:
            ev = await queue.get()
            tokens += len(ev.token_ids)
            if ev.text_delta:
                times.append(time.perf_counter())
            if ev.finished:
                return _sample(t0, times, tokens)

    return await _closed_loop(one, prompts, c)


def _pct(values, q) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def _summary(samples: list[_Sample], wall: float) -> dict:
    tokens = sum(s.tokens for s in samples)
    return {"requests": len(samples), "tokens": tokens, "wall_s": round(wall, 3),
            "throughput_tok_s": round(tokens / wall, 2),
            "ttft_p50_ms": round(1e3 * _pct([s.ttft for s in samples], 50), 1),
            "ttft_p90_ms": round(1e3 * _pct([s.ttft for s in samples], 90), 1),
            "tpot_p50_ms": round(1e3 * (_pct([s.tpot for s in samples], 50) or 0), 2),
            "tpot_p90_ms": round(1e3 * (_pct([s.tpot for s in samples], 90) or 0), 2)}


def run_http_bench(cfg: HttpBenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark (module docstring); returns {"config", "runs", "results", "machine"}.

    Raises:
        ConfigError: bad configuration, or a server that does not come up (its log tail is named).
    """
    from ..runtime.api import Runtime
    from ..runtime.service import Service
    from .engine import AsyncEngine

    say = progress or (lambda m: None)
    engine_dir = check_engine_dir(cfg.engine_dir)
    if not cfg.concurrency or any(c < 1 for c in cfg.concurrency):
        raise ConfigError(f"concurrency: expected integers >= 1, found {cfg.concurrency}")
    counts = {c: cfg.requests or max(4, c) for c in cfg.concurrency}
    port, model = _free_port(), "bench"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dspark-bench-http-{port}.log"
    cmd = [sys.executable, "-m", "dspark_export.cli", "serve", "--engine-dir", str(engine_dir), "--port", str(port),
           "--policy", cfg.policy, "--model-name", model, "--max-queue", "256", "--threads", str(cfg.threads),
           "--api-key", ""]
    say(f"starting the server: {' '.join(cmd)} (log {log_path})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        say(f"loading {engine_dir} in-process")
        runtime = Runtime.open(engine_dir, policy=cfg.policy, threads=cfg.threads)
        engine = AsyncEngine(Service(runtime, cfg.policy)).start()
        prompts = _prompts(cfg, max(counts.values()), runtime)
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc, cfg.server_start_timeout_s, log_path)
        mnt = cfg.max_new_tokens
        if cfg.warmup:
            say("warm-up (both modes, unmeasured)")
            asyncio.run(_inproc_run(engine, runtime, prompts[:4], 4, 8))
            asyncio.run(_http_run(base, model, prompts[:4], 4, 8))
        runs = []
        for rep in range(cfg.repeats):
            for c in cfg.concurrency:
                modes = ("inproc", "http") if (rep + cfg.concurrency.index(c)) % 2 == 0 else ("http", "inproc")
                for mode in modes:
                    ps = prompts[:counts[c]]
                    samples, wall = asyncio.run(_inproc_run(engine, runtime, ps, c, mnt) if mode == "inproc"
                                                else _http_run(base, model, ps, c, mnt))
                    row = {"mode": mode, "concurrency": c, "repeat": rep, **_summary(samples, wall)}
                    runs.append(row)
                    say(f"repeat {rep + 1}/{cfg.repeats} C={c:2d} {mode:6s}: {row['throughput_tok_s']:7.1f} tok/s, "
                        f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms")
        engine.stop()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return {"config": {**asdict(cfg), "engine_dir": str(engine_dir), "command": " ".join(sys.argv)},
            "runs": runs, "results": _combine(runs, cfg), "machine": _machine()}


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    import httpx2 as httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"bench http: the server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ConfigError(f"bench http: the server was not healthy after {timeout} s; see {log_path}")


def _combine(runs: list[dict], cfg: HttpBenchConfig) -> list[dict]:
    """Per C: medians over repeats of each mode, and the paired HTTP overhead (median, min, max)."""
    out = []
    for c in cfg.concurrency:
        by = {m: [r for r in runs if r["concurrency"] == c and r["mode"] == m] for m in ("inproc", "http")}
        row: dict = {"concurrency": c}
        for m, rs in by.items():
            for k in ("throughput_tok_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms"):
                row[f"{m}_{k}"] = round(statistics.median(r[k] for r in rs), 2)
        overhead = [100 * (1 - h["throughput_tok_s"] / i["throughput_tok_s"])
                    for i, h in zip(by["inproc"], by["http"])]
        row.update(overhead_pct=round(statistics.median(overhead), 1), overhead_min_pct=round(min(overhead), 1),
                   overhead_max_pct=round(max(overhead), 1),
                   ttft_added_p50_ms=round(row["http_ttft_p50_ms"] - row["inproc_ttft_p50_ms"], 1))
        out.append(row)
    return out


def _machine() -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "loadavg_at_end": load}


def markdown_table(result: dict) -> str:
    lines = ["| C | tok/s in-process | tok/s HTTP | HTTP overhead % (median [min, max]) | TTFT p50/p90 ms in-process "
             "| TTFT p50/p90 ms HTTP | TPOT p50 ms in-process | TPOT p50 ms HTTP |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(f"| {r['concurrency']} | {r['inproc_throughput_tok_s']:.1f} | {r['http_throughput_tok_s']:.1f} | "
                     f"{r['overhead_pct']:+.1f} [{r['overhead_min_pct']:+.1f}, {r['overhead_max_pct']:+.1f}] | "
                     f"{r['inproc_ttft_p50_ms']:.0f} / {r['inproc_ttft_p90_ms']:.0f} | "
                     f"{r['http_ttft_p50_ms']:.0f} / {r['http_ttft_p90_ms']:.0f} | {r['inproc_tpot_p50_ms']:.1f} | "
                     f"{r['http_tpot_p50_ms']:.1f} |")
    return "\n".join(lines)


def write_reports(result: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "http_bench.json", "markdown": out / "http_bench.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    cfg = result["config"]
    paths["markdown"].write_text(
        f"# HTTP load benchmark\n\ncommand: `{cfg['command']}`\n\nengine dir: {cfg['engine_dir']}, policy "
        f"{cfg['policy']}, max_new_tokens {cfg['max_new_tokens']}, greedy, chat prompts from "
        f"{', '.join(cfg['datasets'])}, {cfg['repeats']} repeats (modes interleaved, order alternating); "
        f"machine: {result['machine']}\n\n" + markdown_table(result) + "\n")
    return paths
