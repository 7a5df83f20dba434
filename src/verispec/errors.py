"""The one exception type users see for bad input or a broken environment."""


class VerispecError(ValueError):
    """Bad input, a missing or corrupted model, or an unsupported combination.

    The message names the problem and, where there is one, the fix. The CLI prints it
    without a traceback and exits with status 2.
    """
