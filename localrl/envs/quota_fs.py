"""An episode's working directory as a file system of the disk quota's size: the quota held by construction.

As root, where the kernel lends loop devices and ``mkfs.ext4`` is installed, each episode directory of the shell
environment is the root of its own ext4 file system, in a sparse image exactly ``quota`` bytes long. A write past
it fails with ENOSPC whatever the path's depth or length, files held open after deletion included, and the host's
disk never holds more of the episode than the image's size (less: ext4's own tables take a share of it). The
sandbox's walk (``disk_usage``, every 20 ms) still runs behind it, and is what holds the quota elsewhere.

The image is unlinked as soon as its loop device is attached (``LO_FLAGS_AUTOCLEAR``): unmounting the directory
frees the device and the image's blocks, and nothing is left on disk for a killed process but the mount itself,
which the next sweep of stale directories unmounts (``shell.remove_workdir``). Images are copied from one made by
``mkfs.ext4`` per size and process (its name unlinked too), so an episode pays a copy of a few hundred kilobytes
and two system calls, not a format.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

from localrl.envs import confine

LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LO_FLAGS_AUTOCLEAR = 0x4C82, 0x4C0A, 4
MS_NOATIME = 1024
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
_libc = ctypes.CDLL(None, use_errno=True)
_lock = threading.Lock()
_templates: dict[tuple[int, int], int] = {}  # (file system, size) -> an open, unlinked, formatted image
_broken: list[str] = []  # why this process gave up on them, once any attempt failed


def possible() -> bool:
    """Whether this process may try: root, a loop-control device, ``mkfs.ext4``, and no earlier failure."""
    return os.geteuid() == 0 and not _broken and os.path.exists("/dev/loop-control") and _mkfs() is not None


def _mkfs() -> str | None:
    return shutil.which("mkfs.ext4", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def mount(workdir: Path, quota: int) -> bool:
    """Make the empty directory ``workdir`` the root of a new file system of ``quota`` bytes (mode 700, owned by
    root, nothing in it); whether it did. A failure (no free loop device, a kernel without LOOP_CONFIGURE, a
    container that forbids mounts) is remembered, and the walk holds the quota from then on."""
    if not possible():
        return False
    try:
        with _lock:
            template = _template(str(workdir.parent), quota)
        _attach(_copy(template, workdir.parent, quota), workdir)
    except OSError as e:
        _broken.append(f"{workdir}: {e}")
        return False
    try:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(workdir / "lost+found")
        os.chmod(workdir, 0o700)
    except OSError:
        unmount(workdir)
        raise
    return True


def mounted(path: Path) -> bool:
    """Whether ``path`` (a directory, not followed if a link) is a mount point: its device differs from its
    parent's."""
    try:
        return os.lstat(path).st_dev != os.lstat(path.parent).st_dev
    except OSError:
        return False


def unmount(path: Path) -> bool:
    """Detach the file system mounted at ``path`` (without following a link there); whether it did."""
    return _libc.umount2(os.fsencode(path), MNT_DETACH | UMOUNT_NOFOLLOW) == 0


def _template(folder: str, quota: int) -> int:
    key = (os.stat(folder).st_dev, quota)  # one per file system: copies stay on it
    if key not in _templates:
        fd, name = tempfile.mkstemp(prefix=".localrl-quota-", suffix=".img", dir=folder)
        try:
            os.ftruncate(fd, quota)
            subprocess.run([_mkfs() or "mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode",
                            "-E", "lazy_itable_init=1,root_owner=0:0", name], check=True, capture_output=True,
                           timeout=60, stdin=subprocess.DEVNULL)
        except (subprocess.SubprocessError, OSError) as e:
            os.close(fd)
            raise OSError(f"mkfs.ext4 failed: {e}") from None
        finally:
            os.unlink(name)
        _templates[key] = fd
    return _templates[key]


def _copy(template: int, folder: Path, quota: int) -> int:
    """A new unlinked image file in ``folder`` holding the template's data (holes stay holes); its open fd."""
    fd, name = tempfile.mkstemp(prefix=".localrl-quota-", suffix=".img", dir=folder)
    os.unlink(name)
    try:
        os.ftruncate(fd, quota)
        offset = 0
        while True:
            try:
                start = os.lseek(template, offset, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data past offset
                    return fd
                raise
            end = os.lseek(template, start, os.SEEK_HOLE)
            while start < end:
                start += os.copy_file_range(template, fd, end - start, start, start) or _pcopy(template, fd, start,
                                                                                             end)
            offset = end
    except OSError:
        os.close(fd)
        raise


def _pcopy(src: int, dst: int, start: int, end: int) -> int:
    data = os.pread(src, min(end - start, 2**20), start)
    return os.pwrite(dst, data, start)


def _attach(image: int, workdir: Path) -> None:
    """Attach ``image`` (closed here) to a free loop device that clears itself, and mount it at ``workdir``."""
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(8):  # another process may take the free device first
                number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
                loop = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
                try:
                    info = bytearray(232)
                    struct.pack_into("I", info, 52, LO_FLAGS_AUTOCLEAR)
                    fcntl.ioctl(loop, LOOP_CONFIGURE, struct.pack("II", image, 0) + bytes(info) + bytes(64))
                except OSError as e:
                    os.close(loop)
                    if e.errno == errno.EBUSY:
                        continue
                    raise
                break
            else:
                raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(control)
        try:  # the mount holds the device from here; closing ours lets autoclear free it on unmount
            confine.mount(_libc, f"/dev/loop{number}", str(workdir), "ext4",
                          confine.MS_NOSUID | confine.MS_NODEV | MS_NOATIME)
        finally:
            os.close(loop)
    finally:
        os.close(image)
