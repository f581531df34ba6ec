"""What every engine runner shares (ONNX Runtime `OrtRunner`, TensorRT `TrtEngineRunner`): the context
manager protocol, the input metadata, and the feed check that runs before each call."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..errors import RequestError

__all__ = ["EngineRunner"]


class EngineRunner:
    """Base of the backends' runners. Subclasses set `key` (EngineKey) and, once active, `_meta`
    ({input name: (numpy dtype, rank)}), and implement `activate`, `deactivate` and `infer`."""

    key = None
    _meta: dict = {}

    def activate(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def deactivate(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self):
        return self.activate()

    def __exit__(self, *exc):
        self.deactivate()

    def padded_rows(self, rows: int) -> int:
        """The rows a feed of `rows` real rows is padded to: the engine's bucket (its shapes are fixed)."""
        return int(self.key.bucket)

    def input_metadata(self) -> dict[str, tuple[type, int]]:
        """{input name: (numpy dtype, rank)}."""
        return dict(self._meta)

    def check_feed(self, feed: Mapping[str, np.ndarray]) -> None:
        """Names, dtypes and ranks of a feed against the engine's inputs.

        Raises:
            RequestError: a missing/unexpected input, or a wrong dtype or rank (names the input).
        """
        if set(feed) != set(self._meta):
            raise RequestError(f"engine {self.key.path}: inputs expected {sorted(self._meta)}, found {sorted(feed)}")
        for name, (dtype, rank) in self._meta.items():
            arr = feed[name]
            if arr.dtype != dtype or arr.ndim != rank:
                raise RequestError(f"engine {self.key.path}: input {name!r} expected {np.dtype(dtype)} of rank "
                                   f"{rank}, found {arr.dtype} of shape {arr.shape}")
