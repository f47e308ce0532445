"""The files of an exported Hugging Face directory beside the weights: the tokenizer copied from the model
the run was trained from, and the mode every exported file gets.

An export is a model to hand on (to transformers, vLLM, a colleague), so its files are written readable by
all (0644) as any file a tool writes: safetensors alone writes its file private (0600). A directory without
the tokenizer does not load with ``AutoTokenizer``, so the source's tokenizer files travel with the weights.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from spec.errors import FoldtuneError

#: mode of every file an export writes
EXPORT_FILE_MODE = 0o644
#: the files Hugging Face loaders read for a tokenizer (and the generation defaults), whichever the source has
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


class ExportFilesError(FoldtuneError):
    """A tokenizer file could not be copied (the operating system's reason)."""


def make_readable(*paths: str | Path) -> None:
    """Give each exported file :data:`EXPORT_FILE_MODE`."""
    for path in paths:
        os.chmod(path, EXPORT_FILE_MODE)


def copy_tokenizer(source_dir: str | Path, target_dir: str | Path) -> list[str]:
    """Copy the tokenizer files ``source_dir`` holds (:data:`TOKENIZER_FILES`) into ``target_dir`` with the
    export's mode; returns the names copied ([] when it holds none)."""
    copied = []
    for name in TOKENIZER_FILES:
        source = Path(source_dir) / name
        if not source.is_file():
            continue
        target = Path(target_dir) / name
        try:
            shutil.copyfile(source, target)
            make_readable(target)
        except OSError as exc:
            raise ExportFilesError(f"cannot copy the tokenizer file {source} to {target}: {exc.strerror}") from None
        copied.append(name)
    return copied
