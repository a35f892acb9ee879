"""User-facing errors: the CLI prints these as one line, without a traceback."""


class VaseError(Exception):
    """An error caused by the user's input or environment, with a message that says how to fix it."""


class ConfigError(VaseError):
    """An impossible or unknown setting."""


class Unreproducible(ConfigError):
    """A run trained with a setting vase no longer has: it cannot be continued, though its saved
    weights can still be read (`vase.config_migrations.migrate`)."""


class DataError(VaseError):
    """Missing, corrupt or unknown data."""


class CheckpointError(VaseError):
    """A checkpoint that cannot be trusted or used."""


class NumericalError(VaseError):
    """A NaN or Inf in a loss or gradient."""
