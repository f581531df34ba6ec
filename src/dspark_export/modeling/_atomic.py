"""Atomic folder installation: build in a temporary sibling folder, then rename into place.

A reader therefore sees either no folder, the old folder, or the complete new one, never a half
written one (same idea as the manifest's write-temp-then-rename, STYLE.md B8).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["staging_dir", "install_dir"]

logger = logging.getLogger(__name__)


def staging_dir(final: Path) -> Path:
    """A new empty folder beside ``final`` (same filesystem, so the later rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def _ordinary_permissions(folder: Path) -> None:
    """mkdtemp makes 0700 folders and some writers (safetensors) 0600 files; give the installed folder
    the permissions plain mkdir/open would have (0777/0666 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


def install_dir(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``, replacing an existing ``final`` folder.

    An existing ``final`` is first renamed aside and deleted only after the new folder is in place.
    ``os.rename`` of a folder is atomic on POSIX when both paths are on one filesystem.

    Raises:
        OSError: the rename failed (``staging`` is left for the caller to remove).
    """
    _ordinary_permissions(staging)
    aside = None
    if final.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, aside / final.name)
    try:
        os.rename(staging, final)
    except OSError:
        if aside is not None and not final.exists():
            os.rename(aside / final.name, final)  # put the old folder back
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    logger.debug("installed %s", final)
