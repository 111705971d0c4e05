"""The first process of a sandboxed command on the ``landlock`` and ``process`` isolation levels.

    python -I -S confine.py LEVEL WORKDIR COMMAND...

It makes itself a child subreaper, so every process the command starts (background jobs,
``setsid`` and double-forked daemons included) ends up as its child once its own parent is
gone; runs COMMAND in a forked child; and when the command ends, or a SIGTERM arrives (the
sandbox's timeout), kills every descendant left before it exits with the command's status.
On the ``landlock`` level the child first confines itself before ``exec``:

- Landlock (Linux 5.13+): the file system is read-only except WORKDIR (and writes to /dev
  such as /dev/null), and no file under /proc can be read, so no other process's
  ``/proc/PID/environ`` (Landlock's ptrace rule alone still lets a process of the same user
  read it: measured on Linux 6.18); TCP bind/connect refused (ABI 4+); signals and abstract
  Unix sockets scoped to the sandbox (ABI 6+);
- seccomp: ``socket()`` only for AF_UNIX (no IPv4/IPv6/netlink, so no UDP either) and no
  io_uring (whose socket operations would pass around the filter).

This file runs by path under ``python -I -S``: standard library only, no localrl imports.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import struct
import sys

PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 36, 38, 22
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446

# Landlock file-system rights: reading files, and those that change the file system (execute and
# listing directories stay allowed everywhere)
WRITE_FILE, READ_FILE, TRUNCATE, REFER = 1 << 1, 1 << 2, 1 << 14, 1 << 13
MODIFY = WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym

# seccomp: (audit arch, socket syscall number) per machine
ARCHES = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
IO_URING_SETUP, AF_UNIX, EACCES = 425, 1, 13


class Stop(Exception):
    pass


def landlock_abi(libc) -> int:
    return libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION


def restrict(libc, workdir: str) -> None:
    """Confine this process and its future children (called in the command's child, before exec)."""
    abi = landlock_abi(libc)
    if abi < 1:
        raise OSError("Landlock is not available")
    fs = READ_FILE | MODIFY | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    fields = [fs] + ([3] if abi >= 4 else []) + ([3] if abi >= 6 else [])  # net: bind+connect TCP; scope: unix+signal
    attr = struct.pack(f"{len(fields)}Q", *fields)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.create_string_buffer(attr, len(attr)), len(attr), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    readable = [(f"/{name}", READ_FILE) for name in os.listdir("/") if name != "proc" and os.path.isdir(f"/{name}")]
    rules = readable + [("/dev", READ_FILE | WRITE_FILE | (TRUNCATE if abi >= 3 else 0)), (workdir, fs)]
    for path, access in rules:
        beneath = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = struct.pack("=Qi", access, beneath)  # struct landlock_path_beneath_attr is packed
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.create_string_buffer(rule, len(rule)), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(beneath)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)
    socket_filter(libc)


def socket_filter(libc) -> None:
    arch, sys_socket = ARCHES[platform.machine()]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | EACCES  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EACCES
    program = [
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny),  # another ABI (32-bit calls): refuse
        (ld, 0, 0, 0),  # the syscall number
        (jge, 0, 1, 0x40000000), (ret, 0, 0, deny),  # x32 calls
        (jeq, 0, 1, IO_URING_SETUP), (ret, 0, 0, deny),
        (jeq, 1, 0, sys_socket), (ret, 0, 0, allow),
        (ld, 0, 0, 16), (jeq, 0, 1, AF_UNIX), (ret, 0, 0, allow), (ret, 0, 0, deny),  # socket's domain
    ]
    code = b"".join(struct.pack("=HBBI", *op) for op in program)
    filters = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program), ctypes.addressof(filters))
    if libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0) != 0:  # SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp")


def children() -> list[int]:
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == me:
                found.append(int(name))
    return found


def kill_descendants() -> None:
    """Kill until no child is left: each round's survivors' children are reparented to us."""
    while True:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main(argv: list[str]) -> int:
    level, workdir, *command = argv
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def on_term(signum, frame):
        raise Stop

    signal.signal(signal.SIGTERM, on_term)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            if level == "landlock":
                restrict(libc, workdir)
            os.execvp(command[0], command)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into this code
            os.write(2, f"sandbox: could not start the command: {exc}\n".encode())
        os._exit(126)
    status = 137
    try:
        while True:
            done, wait_status = os.waitpid(-1, 0)
            if done == pid:
                status = os.waitstatus_to_exitcode(wait_status)
                status = 128 - status if status < 0 else status
                break
    except Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_descendants()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
