"""Text-level Python API over an engine directory.

    from dspark_export.runtime.api import Runtime
    rt = Runtime.open("engines/smollm2", policy="dspark-async")
    [result] = rt.generate_text(["What is 2+3?"], chat=True, params=SamplingParams(max_new_tokens=64))
    print(result.text, result.stats.acceptance_length)
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from . import DEFAULT_POLICY
from ..engines.engine_set import EngineSet
from ..engines.ort.runner import check_threads
from ..errors import EngineDirError, RequestError
from .generator import Generator
from .policies import Policy, parse_policy
from .request import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Runtime"]


class Runtime:
    """Engines + tokenizer + policy. Load once, generate many times.

    Args:
        engines (EngineSet): activated engines.
        tokenizer: a transformers tokenizer (from the engine directory's tokenizer/ folder).
        policy (Policy): verification policy.
    """

    def __init__(self, engines: EngineSet, tokenizer, policy: Policy):
        self.engines, self.tokenizer, self.policy = engines, tokenizer, policy
        self.generator = Generator(engines, policy, detokenize=self.decode)

    @classmethod
    def open(cls, engine_dir: str | Path, policy: str | Policy = DEFAULT_POLICY, verify: bool = True,
             threads: int = 0, backend: str = "onnxruntime", prepack: bool = True) -> "Runtime":
        """Load and check an engine directory, activate all its engines, load its tokenizer.

        `prepack=False` trades the shared prepacked sessions (about 2× faster multi-row passes on CPU, one
        packed weight copy per graph) for less memory (`engines/ort/runner.py`).

        Raises:
            EngineDirError: missing/altered files, bad manifest, unreadable graphs or tokenizer.
            RequestError: unknown policy.
        """
        check_threads(threads)
        pol = policy if isinstance(policy, Policy) else parse_policy(policy)
        engines = EngineSet.open(Path(engine_dir), verify=verify, threads=threads, backend=backend,
                                 prepack=prepack).activate_all()
        return cls(engines, _load_tokenizer(engines), pol)

    def set_policy(self, policy: str | Policy) -> None:
        self.policy = policy if isinstance(policy, Policy) else parse_policy(policy)
        self.generator = Generator(self.engines, self.policy, detokenize=self.decode)

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated ids (special tokens skipped); stop strings are matched on this text."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text_of(self, result: GenerationResult) -> str:
        """The result's text, ending before its stop string when one ended it (as vLLM / OpenAI)."""
        text = self.decode(result.token_ids) if result.token_ids else ""
        if isinstance(result.stop_reason, str) and result.stop_reason in text:
            text = text[:text.index(result.stop_reason)]
        return text

    def encode(self, prompt: str, chat: bool) -> list[int]:
        """Token ids of `prompt`; with `chat`, the tokenizer's chat template, one user turn, with the
        generation prompt (no special tokens added on top; DeepSpec spec §5.2 pitfall 13)."""
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("chat: this engine directory's tokenizer has no chat template")
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def generate_ids(self, prompts: list[list[int]], params: list[SamplingParams],
                     on_finish=None) -> list[GenerationResult]:
        return self.generator.generate(prompts, params, on_finish)

    def generate_text(self, prompts: list[str], params: SamplingParams | list[SamplingParams],
                      chat: bool = False, on_finish=None) -> list[GenerationResult]:
        """Encode, generate, decode. A prompt that cannot be encoded fails alone. `on_finish(position, result)`
        sees the result as the generator finished it (ids and finish reason; `text` is set on return)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids, errors = [], {}
        for i, p in enumerate(prompts):
            try:
                ids.append(self.encode(p, chat))
            except RequestError as e:
                ids.append([])
                errors[i] = str(e)
        t0 = time.perf_counter()
        results = self.generate_ids(ids, params_list, on_finish)
        log.debug("generated %d requests in %.2f s", len(prompts), time.perf_counter() - t0)
        for i, r in enumerate(results):
            if i in errors:
                r.finish_reason, r.error, r.token_ids = "error", errors[i], []
            r.text = self.text_of(r)
        return results


#: tokenizer classes that are the `tokenizers` backend itself: AutoTokenizer would instantiate exactly
#: this class from tokenizer.json, so it is loaded directly (see `_load_tokenizer`)
_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_tokenizer(engines: EngineSet):
    """The engine directory's tokenizer (`manifest.tokenizer.path`).

    A tokenizer saved as the `tokenizers` backend itself (`tokenizer_class` in `_BACKEND_CLASSES`, as
    the GGUF route saves SmolLM2's) is loaded with that class directly: `AutoTokenizer` would build the
    same object, but importing it pulls in torch through transformers' config machinery, most of
    `Runtime.open`'s time (reports/measurement_history.md, "tokenizer load"). Model-specific classes (LlamaTokenizer,
    Qwen2Tokenizer, ...) may rebuild parts of the tokenizer in their constructors, so they still go
    through `AutoTokenizer`.

    Raises:
        EngineDirError: the tokenizer folder is missing or does not load.
    """
    tok = engines.manifest.data.get("tokenizer", {}).get("path", "tokenizer")
    path = engines.manifest.path_of(tok, "tokenizer.path")
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}                     # AutoTokenizer below reports what is wrong with the folder
    try:
        if isinstance(config, dict) and config.get("tokenizer_class") in _BACKEND_CLASSES \
                and (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer file raises KeyError, JSON errors, OSError, ...
        raise EngineDirError(f"{path}: could not load the tokenizer ({type(e).__name__}: {e})") from e
