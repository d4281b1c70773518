"""Where an export may go, and how it gets there without ever leaving a user's folder half-replaced.

An export is written into a staging folder beside its final place (`.quantkit-tmp-NAME.PID-XXXX`), then
moved in: a previous export is first renamed aside (`.quantkit-old-NAME.PID-XXXX`), the new one renamed in,
the old one deleted. A crash at any moment leaves the old or the new export at NAME, or the old one aside,
which the next run puts back (`clean_stale`). Staging folders carry the writer's process id, so a run never
removes the folder of another one still running; streaming writers can fill `staged_output`'s folder layer
by layer. One run writes an output at a time (`output_lock`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantkit.qtensor import QuantizationError

log = logging.getLogger("quantkit")

TMP_PREFIX = ".quantkit-tmp-"
OLD_PREFIX = ".quantkit-old-"
MARKER = "quantkit.json"  # every export holds it: what --overwrite may replace


def _contains(folder: Path, path: Path) -> bool:
    return path == folder or folder in path.parents


def protected_folder(source: str | Path | None) -> Path | None:
    """The folder holding a local source model (a model folder, or a .gguf file's folder); None for hub names."""
    if source is None:
        return None
    path = Path(source).expanduser()
    if not path.exists():
        return None
    path = path.resolve()
    return path if path.is_dir() else path.parent


def check_output_target(output: Path, overwrite: bool, protected: Path | None = None) -> None:
    """Refuse, in one line, any output that would replace something the user did not ask to lose."""
    output = output.expanduser().resolve()
    if output.exists() and not output.is_dir():
        raise QuantizationError(f"output {output} is an existing file, not a folder: choose another --output")
    if protected is not None and _contains(output, protected):
        raise QuantizationError(f"output {output} holds the source model {protected}: choose another --output")
    if not output.exists():
        return
    if not overwrite:
        raise QuantizationError(f"output folder {output} already exists (pass --overwrite to replace it)")
    if _contains(output, Path.cwd().resolve()):
        raise QuantizationError(f"--overwrite refused: {output} is the current folder or one above it")
    if _contains(output, Path.home().resolve()):
        raise QuantizationError(f"--overwrite refused: {output} is the home folder or one above it")
    if protected is not None and _contains(protected, output):
        raise QuantizationError(f"--overwrite refused: {output} is inside the source model's folder {protected}")
    if any(output.iterdir()) and not (output / MARKER).is_file():
        raise QuantizationError(
            f"--overwrite refused: {output} is not empty and is not a quantkit export (no {MARKER}); "
            "move its files away or choose another --output"
        )


LOCK_SUFFIX = ".quantkit-lock"


def lock_path(output: Path) -> Path:
    output = output.expanduser().resolve()
    return output.parent / f".{output.name}{LOCK_SUFFIX}"


@contextmanager
def output_lock(output: Path) -> Iterator[Path]:
    """Held for a whole run on `output`: a second run on it stops at once, naming the process that holds it.

    An exclusive flock on `.NAME.quantkit-lock` beside the output, which holds the owner's process id. The kernel
    drops the lock when its process dies, so a killed run's lock file is taken over (and said so) by the next run.
    """
    path = lock_path(output)
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise QuantizationError(f"cannot create the lock {path}: {err.strerror or err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise QuantizationError(f"{output} is being written by another quantkit run (process {holder}); "
                                    "wait for it to finish or choose another --output") from None
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # the file was removed by its owner between our open and our lock: take the new one
    previous = os.read(fd, 32).decode(errors="replace").strip()
    if previous:
        log.warning("took over %s from process %s, which ended without releasing it", path.name, previous)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: a run waiting on this inode sees it gone and retries
        os.close(fd)


def _writer_alive(folder: Path) -> bool:
    pid = folder.name.rsplit(".", 1)[-1].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _unique(parent: Path, prefix: str, name: str) -> Path:
    return parent / f"{prefix}{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"


def clean_stale(output: Path) -> list[str]:
    """Put back an export left aside by a killed replace, remove killed runs' staging folders; say what was done."""
    output = output.expanduser().resolve()
    done: list[str] = []
    if not output.parent.is_dir():
        return done
    for old in sorted(output.parent.glob(f"{OLD_PREFIX}{output.name}.*")):
        if _writer_alive(old):
            continue
        if not output.exists():
            old.rename(output)
            done.append(f"restored {output} from {old.name}, left aside by a killed run")
        else:
            shutil.rmtree(old)
            done.append(f"removed {old.name}, a previous export a killed run had already replaced")
    for tmp in sorted(output.parent.glob(f"{TMP_PREFIX}{output.name}.*")):
        if not _writer_alive(tmp):
            shutil.rmtree(tmp)
            done.append(f"removed {tmp.name}, the unfinished output of a killed run")
    done += _clean_legacy(output)
    for line in done:
        log.warning(line)
    return done


def _clean_legacy(output: Path) -> list[str]:
    """Before the prefix, exports were staged in tempfile.mkdtemp(prefix=".NAME."): remove such folders left
    empty by a killed run (a non-empty one may be someone's: only mentioned)."""
    said = []
    for folder in sorted(output.parent.glob(f".{output.name}.*")):
        if not (folder.is_dir() and re.fullmatch(r"[a-z0-9_]{8}", folder.name.rsplit(".", 1)[-1])):
            continue
        if any(folder.iterdir()):
            said.append(f"{folder} looks like an unfinished export of an older quantkit; remove it if it is not yours")
        else:
            folder.rmdir()
            said.append(f"removed {folder.name}, an empty folder a killed run of an older quantkit left")
    return said


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give folder and its files the user's normal modes (some writers create private 0600 files)."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def replace_atomically(staged: Path, output: Path) -> None:
    """Move staged to output; an existing output goes aside first and is deleted only once the new one is in."""
    aside = None
    if output.exists():
        aside = _unique(output.parent, OLD_PREFIX, output.name)
        output.rename(aside)
    staged.rename(output)
    if aside is not None:
        shutil.rmtree(aside)


@contextmanager
def staged_output(output: str | Path) -> Iterator[Path]:
    """A fresh folder beside output to write into; on success it replaces output atomically, else it is removed."""
    output = Path(output).expanduser().resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = _unique(output.parent, TMP_PREFIX, output.name)
    staged.mkdir()
    try:
        yield staged
        apply_umask(staged)
        replace_atomically(staged, output)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


FREE_SPACE_MARGIN = 64 * 2**20  # tokenizer, configs and the filesystem's own slack


def existing_ancestor(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return path


def check_free_space(folder: Path, nbytes: int, what: str) -> None:
    base = existing_ancestor(folder)
    free = shutil.disk_usage(base).free
    if free < nbytes + FREE_SPACE_MARGIN:
        raise QuantizationError(f"{what} needs about {_megabytes(nbytes + FREE_SPACE_MARGIN)} in {base}, "
                                f"which has {_megabytes(free)} free; free space or choose another place")


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"
