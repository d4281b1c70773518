"""The error a user can cause, shown as one clear line: its own module so that any layer of quantkit can raise it
without importing the quantization math (quantkit.qtensor re-exports it)."""


class QuantizationError(ValueError):
    """A user-facing quantization error (bad shape, bad option, bad data)."""
