"""Exceptions raised at specdec's boundaries.

Every error a user can cause (a bad checkpoint, a bad request, a prompt that does not fit)
is one of these, and its message names the file, tensor, field or parameter at fault.
"""


class SpecdecError(Exception):
    """Base class of every error specdec raises on purpose."""


class CheckpointError(SpecdecError):
    """A checkpoint file or directory is missing, truncated, corrupt or does not fit the model."""


class ConfigError(SpecdecError):
    """A config field is missing, has the wrong type, or names something unsupported."""


class RequestError(SpecdecError, ValueError):
    """A generation request parameter is out of range or malformed."""


class ContextOverflowError(RequestError):
    """The prompt plus the requested tokens do not fit in the model's context."""


class CompileError(SpecdecError):
    """``--compile``: torch.compile is unavailable here or failed to compile a static step."""


class QueueFullError(SpecdecError):
    """The serving engine already holds as many waiting requests as it was built to queue."""


class EngineStoppedError(SpecdecError):
    """A request was submitted to a serving engine that has been stopped."""
