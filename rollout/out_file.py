"""The Parquet file of `rollout sample` and `rollout demo`: checked writable before any work, written whole."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

_OTHER_FORMATS = {".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".txt", ".arrow", ".feather", ".ipc", ".orc",
                  ".pkl", ".pt", ".npy"}  # a name promising one of these would hold Parquet


def check_out(path: Path) -> None:
    """Refuse an output path that could not be written, before any sampling: a directory, a missing directory,
    or one where no file can be created (tried, so that a run never ends with its samples unwritable); and a
    name ending as another format's files do."""
    if path.suffix.lower() in _OTHER_FORMATS:
        raise ValueError(f"--out {str(path)!r}: the samples are written as Parquet, not {path.suffix[1:]}; "
                         "name the file *.parquet")
    if path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a directory")
    if not path.parent.is_dir():
        raise ValueError(f"--out {str(path)!r}: directory {str(path.parent)!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise ValueError(f"--out {str(path)!r}: cannot create a file in {str(path.parent)!r} "
                         f"({err.strerror or err})") from None


def write_out(table: pa.Table, path: Path) -> None:
    """Write `table` to `path` whole or not at all: into a hidden file beside it, renamed over `path` once
    complete, so a failed or interrupted write leaves no half file and an earlier file as it was."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        pq.write_table(table, partial)
        os.replace(partial, path)
    except BaseException as err:
        partial.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OSError(f"could not write --out {str(path)!r}, the {table.num_rows} samples are lost: "
                          f"{err}") from None
        raise
