"""Error hierarchy. Every error message says what was expected, what was found, and where."""


class DsparkExportError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(DsparkExportError, ValueError):
    """A model, drafter or engine configuration is invalid or does not fit its partner."""


class CheckpointError(DsparkExportError):
    """A checkpoint file or folder is missing, unreadable or holds the wrong tensors."""


class ExportError(DsparkExportError):
    """A graph could not be exported or does not meet its I/O contract."""


class PluginError(DsparkExportError, ValueError):
    """A custom op got inputs that violate its schema."""


class BuildError(DsparkExportError):
    """An engine directory could not be built."""


class ProfileError(DsparkExportError):
    """The throughput profile could not be measured or is unusable."""


class EngineDirError(DsparkExportError):
    """An engine directory is incomplete, altered, or its manifest is invalid."""


class RequestError(DsparkExportError, ValueError):
    """A generation request is invalid (bad parameters, prompt too long for the engine's capacity)."""


class EngineRunError(DsparkExportError):
    """An engine call raised while generating. The runtime fails only the requests the call served
    (after retrying each alone) and keeps serving the others."""
