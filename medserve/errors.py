"""Errors raised at medserve's input boundaries.

Every error names the offending file, field or rule and says what was expected, so that the CLI can print it
as one line and the server can return it as a 4xx JSON body.
"""


def one_line(message: str) -> str:
    """`message` with its non-printable characters escaped (a newline as \\n, an escape as \\x1b): a file name
    that holds them must not split an `error:` line in two or move the terminal's cursor."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in message)


class MedserveError(Exception):
    """Base class of every error a user can cause with bad input."""


class DicomInputError(MedserveError):
    """The DICOM input (folder, file, series) cannot be used."""


class NiftiInputError(MedserveError):
    """The NIfTI input (the server's other input format) cannot be used."""


class SelectionError(MedserveError):
    """No series matched the selection rules, or the rules are malformed."""


class VolumeError(MedserveError):
    """The selected series does not form a regular volume."""


class BundleError(MedserveError):
    """The MONAI bundle (layout, config, weights) cannot be loaded."""


class InferenceError(BundleError):
    """A loaded bundle's preprocessing, network or postprocessing failed on one input."""


class InferenceOutOfMemory(InferenceError):
    """Inference ran out of GPU or host memory: the same input may succeed later, smaller, or elsewhere."""


class PackagingError(MedserveError):
    """A MAP cannot be built, pushed, inspected or run (bad app dir, app.yaml, models, registry, engine)."""


class ConfigurationError(MedserveError):
    """The server's own configuration (tokens file, MEDSERVE_TOKENS, options) is unusable."""


class OutputError(MedserveError):
    """A result file cannot be written (folder not writable, disk full); nothing partial is left under its name."""


class WiringError(MedserveError, TypeError):
    """An operator received on a port what the operator wired to it does not give (a stock operator's output where
    ours is expected): the app's graph, the user's own code, connects the wrong ports."""


def first_line(error: BaseException) -> str:
    """An error's message in one line, for messages that embed another library's (torch's and pydicom's run on
    for many lines); its type name when it has no message."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def on_one_line(text: object) -> str:
    """A message with all its lines kept, joined by single spaces: for libraries that list one reason per line
    (pydicom names each decoder plugin's failure on a line of its own, where first_line would keep a header)."""
    return " ".join(str(text).split())


def described(value: object) -> str:
    """What a config built or held, for an error line: its type and the start of its repr."""
    if value is None:
        return "null"
    text, kind = on_one_line(repr(value)), type(value).__qualname__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return f"{article} {kind} ({text if len(text) <= 60 else text[:57] + '...'})"
