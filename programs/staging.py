"""Writing files and folders whole, so that no kill leaves anything half-written or behind.

A file or folder is first written under a staging name beside its target,

    .<target name>.staging-<pid>-<random>

locked (flock) by the process writing it, and renamed to the target once complete: the target is
whole or absent, whatever stops the writer. A writer stopped by an exception removes its staging
entry itself; one killed outright (SIGKILL, a power cut) cannot, so every staged write first sweeps
its folder (and `default_model_dir`, the cache's) of stale entries: those whose lock it can take,
which the kernel releases when their process dies, and whose process is gone (or, should its pid have
been reused, which are older than a minute). A live writer's entry is never touched: it holds its
lock from the moment its entry exists, but for the instant between creating and locking it, when its
pid is alive and the entry new.

Reading, changing and writing back a file that concurrent runs share (the cache's latency.json) goes
under `locked(path)`, so that no run's change is lost to another's.
"""

import fcntl
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARK = ".staging-"
GRACE_SECONDS = 60  # an unlocked entry whose pid runs again (reused) is stale only after this


def staging_name(target: Path) -> Path:
    return target.with_name(f".{target.name}{MARK}{os.getpid()}-{secrets.token_hex(4)}")


@contextmanager
def staged_file(target: Path) -> Iterator[Path]:
    """A staging path to write `target`'s content to; renamed to `target` when the block ends without
    an exception, removed if it raises."""
    remove_stale(target.parent)
    staging = staging_name(target)
    lock = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield staging
        staging.replace(target)
    finally:
        staging.unlink(missing_ok=True)
        os.close(lock)


@contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """A staging folder to fill with `target`'s files; it replaces `target` (and whatever was there)
    when the block ends without an exception, and is removed if it raises."""
    remove_stale(target.parent)
    staging = staging_name(target)
    staging.mkdir()
    lock = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield staging
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(lock)


def remove_stale(folder: Path) -> list[Path]:
    """Remove the staging entries in `folder` whose writer is dead (see the module docstring); returns
    them."""
    try:
        entries = [entry for entry in folder.iterdir() if entry.name.startswith(".") and MARK in entry.name]
    except OSError:  # no such folder yet, or unreadable: nothing of ours to sweep
        return []
    return [entry for entry in entries if writer_is_dead(entry) and remove(entry)]


def writer_is_dead(entry: Path) -> bool:
    try:
        pid = int(entry.name.rsplit(MARK, 1)[1].split("-")[0])
        handle = os.open(entry, os.O_RDONLY)
    except (ValueError, IndexError, OSError):  # not a name of ours, or gone already
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # locked: its writer lives
    finally:
        os.close(handle)  # (releases the lock if we took it)
    try:
        age = time.time() - entry.lstat().st_mtime
    except OSError:
        return False
    return not process_exists(pid) or age > GRACE_SECONDS


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove(entry: Path) -> bool:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)
    return not entry.exists()


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path`'s lock file (path + ".lock", beside it) for the block:
    concurrent runs that read, change and write `path` take turns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def read_saved(path: Path) -> dict:
    """A JSON object saved in the cache; {} when there is none or the file is damaged."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def write_saved(path: Path, saved: dict) -> None:
    """`saved` as JSON at `path`, written whole (staged_file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(path) as staging:
        staging.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
