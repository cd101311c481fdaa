"""The one kind of error an entry point turns into a message: a mistake in what the user gave it.

Every entry point (train.py, eval.py, retrieval.server, retrieval.build_index, retrieval.import_searchr1,
scripts/prepare_data.py) catches InputError alone and prints its text with a non-zero exit, no traceback.
Anything else is a bug of ours and keeps its traceback. So an InputError's text must stand alone: it
names the file (and line, or field) or the flag, says what was found and what was expected, and what to
do. The loaders' own errors (RowError, ManifestError, CorpusError, ConfigError, ...) derive from it.
"""

from __future__ import annotations


class InputError(ValueError):
    """A user's input is wrong: a file, a folder, a flag. The message says which and what to do."""


class InputFileMissing(InputError, FileNotFoundError):
    """A file or folder the user named is not there (still a FileNotFoundError for older callers)."""


class InputFileExists(InputError, FileExistsError):
    """A file or folder the user named would be overwritten (still a FileExistsError for older callers)."""


class MissingPackage(InputError, ImportError):
    """An optional package the user's choice needs is not installed (the message names the pip line)."""


def entry_point_error(prog: str, e: InputError) -> int:
    """Print `prog: error: <message>` to stderr and return the exit code of an input error (2, as argparse)."""
    import sys

    print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
    return 2
