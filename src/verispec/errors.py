"""The one exception type users see for bad input or a broken environment."""


class VerispecError(ValueError):
    """Bad input, a missing or corrupted model, or an unsupported combination.

    The message names the problem and, where there is one, the fix. The CLI prints it
    without a traceback and exits with status 2.
    """


class ConstraintError(VerispecError):
    """A structured-output constraint (a JSON schema, regex or grammar) that cannot be used: past the bounds on what
    its compiler would have to do, invalid, or too costly while decoding. The client's mistake (HTTP 400)."""


# Panics in native extensions built with pyo3 (llguidance, tokenizers) arrive as pyo3's PanicException, which derives
# from BaseException so that `except Exception` lets it through. A guard that confines a fault to its row must catch
# it too, and nothing else that is not an Exception (an interrupt, an exit).
_NOT_FAULTS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def is_fault(err: BaseException) -> bool:
    """Whether a fault guard should absorb `err`: any Exception, and a panic from native code; never an interrupt or
    an exit (those end the process as they should)."""
    return isinstance(err, Exception) or not isinstance(err, _NOT_FAULTS)
