"""One writer per run directory, and per store: a lock with a fencing token.

Two trainers on one run directory would each append the same metrics rows, overwrite each
other's config and checkpoints, and split the cost ledger. On spot capacity this is the common
case: a replacement trainer starts while the old one is still draining. So every command that
writes a run directory (`spotlight train`, `spotlight vlm train`, `spotlight pretrain --out`)
holds `RunLock` for its whole life:

- **Locally**, `RUN_DIR/.lock` is held with `flock` (advisory, exclusive). The kernel drops it when
  its process ends however it ends (SIGKILL included), so a dead holder never blocks the next
  trainer, and a live one always does: the second trainer stops with a one-line error that names
  the holder's host, pid and start time and says how to take over. The file also records a
  *fencing token*: one more than the previous holder's.
- **In the store** (`log.store_url`), a replacement machine cannot see the old machine's flock, so
  the holder also keeps a lease object, `STORE_LEASE`, that it renews every third of
  `log.store_lease_s`. A new trainer takes the store over only when that lease has expired, was
  released, or names a process on this host that no longer runs; its token is one above every
  token seen. A holder that finds a higher token in the store (someone took over while it was
  unreachable) is *fenced*: `check()` raises, and the mirror publishes nothing more, so a draining
  old trainer cannot overwrite its replacement's checkpoints.

The store check is read-then-write, not an atomic compare-and-swap: two trainers that start
within the same instant on two machines could both take it. The lease covers the case that
matters on spot capacity, a replacement started while the old machine is unreachable or slow.
(S3 conditional writes, `If-Match`, could close that window; not every S3 stand-in supports them.)
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
"""In the run directory: held with flock; its text is the holder's record (JSON)."""
STORE_LEASE = "lease.json"
"""In the store (beside `checkpoints/`): the holder's record, renewed while it runs."""


class RunDirBusy(ValueError):
    """Another live process holds the run directory or the store; the message names it."""


class Fenced(ValueError):
    """A newer holder took over the store: this process must stop writing."""


def _holder(record: dict) -> str:
    started = record.get("started")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    where = f"pid {record.get('pid', '?')} on host {record.get('host', '?')}"
    return f"`{record.get('command', '?')}` ({where}, since {since}, token {record.get('token', '?')})"


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RunLock:
    """Hold `run_dir` (and the store, when given) for one writer; see the module docstring.

    Args:
        run_dir: the directory to hold (created if missing).
        command: what holds it, for the other trainer's message ("spotlight train").
        store: a `spot.store_base.Store` whose lease to take too (the checkpoint mirror's), or None.
        lease_s: how long the store lease lasts without a renewal.
        clock: unix time (tests).
        lock_file: hold this file instead of `run_dir/.lock` (for an output that is renamed into
            place, such as `pretrain --out`: `PARENT/.NAME.lock`); removed on release.

    Raises:
        RunDirBusy: a live process holds the run directory, or an unexpired lease the store.
        ValueError: the run directory cannot be created or written (the message names it).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        command: str,
        *,
        store=None,
        lease_s: float = 120.0,
        clock=time.time,
        lock_file: Path | None = None,
    ):
        if not lease_s > 0:
            raise ValueError(f"log.store_lease_s must be > 0, got {lease_s}")
        self.run_dir = Path(run_dir)
        self.store = store
        self.lease_s = float(lease_s)
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fenced_by: dict | None = None
        self.took_over: dict | None = None
        """The record of a previous holder that had not released (it died): taken over."""
        path = lock_file if lock_file is not None else self.run_dir / LOCK_FILE
        self._path, self._own_file = path, lock_file is not None
        self.what = (
            self.run_dir
            if lock_file is None
            else lock_file.with_name(lock_file.name.removeprefix(".").removesuffix(".lock"))
        )
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ValueError(
                f"--run-dir {self.run_dir} is a file, not a directory; give a directory (a new one starts a run)"
            )
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(
                f"{path}: cannot create the run directory's lock ({err.strerror}); choose a writable --run-dir"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            previous = self._read_local()
            os.close(self._fd)
            raise RunDirBusy(
                f"{self.what} is in use by {_holder(previous)}: it takes one writer. "
                f"Wait for it to end, stop it (kill {previous.get('pid', 'PID')}), or choose another --run-dir"
            ) from None
        try:
            previous = self._read_local()
            if previous and not previous.get("released"):
                self.took_over = previous
            token = int(previous.get("token", 0))
            if store is not None:
                token = max(token, self._take_store())
            self.record = {
                "command": command,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": self._clock(),
                "token": token + 1,
                "run_dir": str(self.run_dir.resolve()),
                "released": False,
            }
            self._write_local()
            if store is not None:
                self._write_store()
                self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
                self._thread.start()
        except BaseException:
            os.close(self._fd)
            raise
        if self.took_over:
            logger.warning(
                "%s: took over from %s, which ended without releasing it", self.run_dir, _holder(self.took_over)
            )

    @property
    def token(self) -> int:
        return self.record["token"]

    # -- local --------------------------------------------------------------------------------

    def _read_local(self) -> dict:
        try:
            text = os.pread(self._fd, 1 << 16, 0).decode("utf-8")
            record = json.loads(text) if text.strip() else {}
            return record if isinstance(record, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_local(self) -> None:
        data = json.dumps(self.record).encode("utf-8")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    # -- store --------------------------------------------------------------------------------

    def _read_store(self) -> dict:
        from spotlight.core.files import MissingKeyError

        try:
            record = json.loads(self.store.get_bytes(STORE_LEASE).decode("utf-8"))
        except MissingKeyError:
            return {}
        except ValueError:
            logger.warning("%s: unreadable lease, treated as released", self.store.where(STORE_LEASE))
            return {}
        return record if isinstance(record, dict) else {}

    def _take_store(self) -> int:
        """The store's token, once its lease is free to take; RunDirBusy while another holds it."""
        lease = self._read_store()
        if not lease or lease.get("released"):
            return int(lease.get("token", 0))
        age = self._clock() - float(lease.get("renewed", 0))
        here = lease.get("host") == socket.gethostname()
        if here and not _pid_alive(lease.get("pid")):
            self.took_over = lease
            return int(lease["token"])
        if age < float(lease.get("lease_s", self.lease_s)):
            left = float(lease.get("lease_s", self.lease_s)) - age
            raise RunDirBusy(
                f"the store {self.store.where(STORE_LEASE)} is held by {_holder(lease)}, renewed {age:.0f} s ago: "
                f"a trainer there may still be running. Its lease expires in {left:.0f} s; start again then, "
                f"or stop that trainer (log.store_lease_s sets the lease)"
            )
        self.took_over = lease
        return int(lease.get("token", 0))

    def _write_store(self) -> None:
        self.store.put_bytes(
            STORE_LEASE, json.dumps({**self.record, "renewed": self._clock(), "lease_s": self.lease_s}).encode("utf-8")
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if self._check_store():
                    self._write_store()
            except Exception as err:  # a store hiccup: the next renewal tries again
                logger.warning("renewing the run's lease in the store failed (%s); retrying", err)

    def _check_store(self) -> bool:
        """Whether this process still holds the store (False, and fenced, if a newer token is there)."""
        lease = self._read_store()
        if int(lease.get("token", 0)) > self.token:
            self.fenced_by = lease
            self._stop.set()
            return False
        return True

    # -- use ----------------------------------------------------------------------------------

    def check(self, *, fresh: bool = True) -> None:
        """Raise `Fenced` if a newer holder took the store over: read from the store now (fresh),
        or as the last renewal found it (no I/O; for every iteration)."""
        if fresh and self.store is not None and self.fenced_by is None:
            self._check_store()
        if self.fenced_by is not None:
            raise Fenced(
                f"{self.run_dir}: a newer trainer, {_holder(self.fenced_by)}, took over this run's store "
                f"{self.store.where(STORE_LEASE)}; this one (token {self.token}) stops without writing more"
            )

    def release(self) -> None:
        """Give the run directory (and the store lease, if still ours) back; idempotent."""
        if self._fd < 0:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.record["released"] = True
        try:
            if self.store is not None and self.fenced_by is None and self._check_store():
                self._write_store()
        except Exception as err:
            logger.warning("releasing the run's lease in the store failed (%s); it expires by itself", err)
        try:
            self._write_local()
            if self._own_file:
                # Not left beside the output (a later holder makes a new one; it needs no token).
                self._path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def remove_if_empty_run(run_dir: str | os.PathLike) -> bool:
    """Remove `run_dir` if the run wrote nothing worth keeping there: no checkpoint and no metrics
    row. For a run directory the failed command itself created (a failed start leaves nothing
    behind; a second try starts clean). Returns whether it removed it."""
    import shutil

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    ckpts = run_dir / "checkpoints"
    metrics = run_dir / "metrics.jsonl"
    if (ckpts.is_dir() and any(ckpts.iterdir())) or (metrics.is_file() and metrics.stat().st_size > 0):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True
