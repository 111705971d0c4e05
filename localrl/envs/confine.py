"""The first process of every sandboxed command: it confines itself, then becomes the command.

    python -I -S confine.py LEVEL WORKDIR UID GID TMP_BYTES CGROUP_PROCS... -- ARGV...

``localrl/envs/sandbox.py`` starts it; it runs as the caller (root or not) and, in this order:

1. joins the command's cgroups (each ``cgroup.procs`` path given), so that every process the
   command ever starts is counted (pids, memory) and can be killed, ``setsid`` or not;
2. by level:

   - ``bwrap``: hands bubblewrap the seccomp filter below (``--seccomp FD``), drops to UID/GID
     and execs ARGV (bubblewrap's command line, built by sandbox.py);
   - ``unshare``: execs ARGV (util-linux ``unshare`` with new mount, PID and network namespaces)
     whose command is this file again at level ``unshare-inside``;
   - ``unshare-inside`` (PID 1 of the new namespaces): makes every mount read-only, mounts a
     fresh ``/dev`` of five nodes and size-capped tmpfs on ``/tmp``, ``/var/tmp`` and ``/dev/shm``,
     binds WORKDIR back read-write, then runs ARGV as below;
   - ``landlock`` and ``process``: becomes a child subreaper (so ``setsid`` and double-forked
     processes stay its descendants), runs ARGV in a forked child and, when ARGV ends or a SIGTERM
     arrives (the sandbox's timeout), kills every descendant before it exits with ARGV's status.

   The forked child (and ``unshare-inside``'s) confines itself before ``exec``: Landlock on the
   ``landlock`` level; an empty capability bounding set, ``PR_SET_NO_NEW_PRIVS`` and UID/GID
   (``-`` keeps the caller's), so nothing in the command holds a capability; then the seccomp
   filter.

Landlock (``landlock`` level, ABI 5 or later, else the level is refused): files can be read and
directories listed only under the system directories and WORKDIR (``stat`` of a path is no Landlock right:
it works anywhere the user may look); written only in WORKDIR and /dev/null, /dev/zero,
/dev/full; no device ioctls outside WORKDIR; no TCP bind or connect; signals and abstract Unix
sockets scoped to the sandbox (ABI 6+).

seccomp, every level: no TIOCSTI or TIOCLINUX ioctl (keystrokes into a terminal), no character or
block device nodes, no mount, umount, new namespaces, ptrace, io_uring, BPF, keyrings, kernel
modules, kexec, syslog or reboot, no Unix or vsock sockets (a host socket's path is reachable through
a read-only mount and from another network namespace). ``landlock`` adds no ``socket()`` at all, and, for a
command run as anyone but nobody, no chmod, chown, utimes or xattr changes at all (Landlock has no
right for metadata, and the owner of a file outside needs no capability to change it; inside the
working directory ``touch`` on an existing file and ``chmod`` fail too). ``process`` commands
that stay root get the same metadata rule.

This file runs by path under ``python -I -S``: standard library only, no localrl imports.
"""

from __future__ import annotations

import ctypes
import os
import _signal as signal  # (the signal module imports enum: twice this file's start-up)
import stat
import struct
import sys

PR_CAPBSET_READ, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 23, 24, 36, 38, 22
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4

# Landlock file-system rights
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
MAKE_CHAR, MAKE_BLOCK, REFER, TRUNCATE, IOCTL_DEV = 1 << 6, 1 << 11, 1 << 13, 1 << 14, 1 << 15
MODIFY = WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
LANDLOCK_MIN_ABI = 5  # IOCTL_DEV: without it a command could ioctl any device it can open
READABLE = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt")
DEVICES = {"null": READ_FILE | WRITE_FILE | TRUNCATE, "zero": READ_FILE | WRITE_FILE | TRUNCATE,
           "full": READ_FILE | WRITE_FILE | TRUNCATE, "random": READ_FILE, "urandom": READ_FILE}

# Syscall numbers (x86_64, aarch64); None where the machine has no such call.
SYSCALLS = {
    "landlock_create_ruleset": (444, 444), "landlock_add_rule": (445, 445), "landlock_restrict_self": (446, 446),
    "mount_setattr": (442, 442), "socket": (41, 198), "ioctl": (16, 29), "clone": (56, 220), "clone3": (435, 435),
    "mknod": (133, None), "mknodat": (259, 33),
}
DENIED = {  # refused with EPERM at every level
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "unshare": (272, 97), "setns": (308, 268),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "syslog": (103, 116), "acct": (163, 89), "swapon": (167, 224),
    "swapoff": (168, 225), "reboot": (169, 142), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
}
METADATA = {  # refused to commands that stay root on the landlock and process levels
    "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452),
    "chown": (92, None), "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54),
    "utime": (132, None), "utimes": (235, None), "futimesat": (261, None), "utimensat": (280, 88),
    "setxattr": (188, 5), "lsetxattr": (189, 6), "fsetxattr": (190, 7), "removexattr": (197, 14),
    "lremovexattr": (198, 15), "fremovexattr": (199, 16), "setxattrat": (463, 463), "removexattrat": (466, 466),
}
MACHINE = os.uname().machine  # (not the platform module: importing it costs more than the rest of this file)
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
S_IFMT, S_IFCHR, S_IFBLK = 0o170000, 0o020000, 0o060000
AF_UNIX, AF_VSOCK, EPERM, EACCES, ENOSYS = 1, 40, 1, 13, 38
NOBODY_UID = 65534
EPISODE_UIDS = range(0x7F000000, 0x7F000000 + 4096)  # an episode's own user each (episode_user.py): owns nothing else
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1


def cap_last() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 63


CAP_LAST = cap_last()  # read now: the confined child can no longer read /proc


class Stop(Exception):
    pass


def nr(table: dict, name: str) -> int | None:
    return table[name][0 if MACHINE == "x86_64" else 1]


def libc_handle():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def check(result: int, what: str) -> None:
    if result < 0:
        raise OSError(ctypes.get_errno(), what)


# -- seccomp -------------------------------------------------------------------------------------------

LD, JEQ, JGE, JSET, AND, RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, ..., ALU|AND|K, RET|K
ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW


def errno(code: int) -> tuple:
    return (RET, 0, 0, 0x00050000 | code)  # SECCOMP_RET_ERRNO


def arg(i: int) -> tuple:
    return (LD, 0, 0, 16 + 8 * i)  # the low 32 bits of syscall argument i (little-endian seccomp_data)


def seccomp_program(no_sockets: bool, no_metadata: bool) -> bytes:
    """The filter as raw ``struct sock_filter`` records (what bwrap's ``--seccomp`` reads). ``socket()`` is refused
    for Unix and vsock sockets everywhere (a mount namespace cannot stop a ``connect()`` to a host socket's path,
    and seccomp cannot read the path), and for every domain with ``no_sockets``."""
    blocks: list[tuple[int, list[tuple]]] = []  # (syscall, instructions that end in a return)
    for name in DENIED:
        if (number := nr(DENIED, name)) is not None:
            blocks.append((number, [errno(EPERM)]))
    if no_metadata:
        blocks += [(number, [errno(EPERM)]) for name in METADATA if (number := nr(METADATA, name)) is not None]
    blocks.append((nr(SYSCALLS, "ioctl"), [arg(1), (JEQ, 2, 0, TIOCSTI), (JEQ, 1, 0, TIOCLINUX), (RET, 0, 0, ALLOW),
                                            errno(EPERM)]))
    blocks.append((nr(SYSCALLS, "clone"), [arg(0), (JSET, 1, 0, CLONE_NEW), (RET, 0, 0, ALLOW), errno(EPERM)]))
    blocks.append((nr(SYSCALLS, "clone3"), [errno(ENOSYS)]))  # its flags are out of reach: libc falls back to clone
    for name, mode_arg in (("mknod", 1), ("mknodat", 2)):
        if (number := nr(SYSCALLS, name)) is not None:
            blocks.append((number, [arg(mode_arg), (AND, 0, 0, S_IFMT), (JEQ, 2, 0, S_IFCHR), (JEQ, 1, 0, S_IFBLK),
                                    (RET, 0, 0, ALLOW), errno(EPERM)]))
    if no_sockets:
        blocks.append((nr(SYSCALLS, "socket"), [errno(EACCES)]))
    else:
        blocks.append((nr(SYSCALLS, "socket"), [arg(0), (JEQ, 2, 0, AF_UNIX), (JEQ, 1, 0, AF_VSOCK), (RET, 0, 0, ALLOW),
                                                 errno(EACCES)]))
    program = [(LD, 0, 0, 4), (JEQ, 1, 0, AUDIT_ARCH[MACHINE]), errno(EPERM),  # another ABI: refuse
               (LD, 0, 0, 0), (JGE, 0, 1, 0x40000000), errno(EPERM)]  # the syscall number; x32 calls refused
    for number, block in blocks:
        program += [(JEQ, 0, len(block), number), *block]  # a block's own loads end in its returns
    program.append((RET, 0, 0, ALLOW))
    return b"".join(struct.pack("=HBBI", *op) for op in program)


def install_seccomp(libc, program: bytes) -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.addressof(code))
    check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0), "seccomp")  # SECCOMP_MODE_FILTER


# -- Landlock ------------------------------------------------------------------------------------------

def landlock_abi(libc) -> int:
    return libc.syscall(nr(SYSCALLS, "landlock_create_ruleset"), None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION


def landlock(libc, workdir: str) -> None:
    """Reads only under the system directories, writes only in ``workdir`` (and three harmless devices)."""
    abi = landlock_abi(libc)
    if abi < LANDLOCK_MIN_ABI:
        raise OSError(f"Landlock ABI {abi} < {LANDLOCK_MIN_ABI} (no device-ioctl rule)")
    fs = READ_FILE | READ_DIR | MODIFY | REFER | TRUNCATE | IOCTL_DEV
    fields = [fs, 3] + ([3] if abi >= 6 else [])  # net: bind+connect TCP; scope: abstract unix + signals
    attr = struct.pack(f"{len(fields)}Q", *fields)
    ruleset = libc.syscall(nr(SYSCALLS, "landlock_create_ruleset"), ctypes.create_string_buffer(attr, len(attr)),
                           len(attr), 0)
    check(ruleset, "landlock_create_ruleset")
    rules = [(path, READ_FILE | READ_DIR) for path in READABLE if os.path.isdir(path)]
    rules += [(f"/dev/{name}", access) for name, access in DEVICES.items() if os.path.exists(f"/dev/{name}")]
    rules.append((workdir, fs))
    for path, access in rules:
        beneath = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = struct.pack("=Qi", access, beneath)  # struct landlock_path_beneath_attr is packed
        check(libc.syscall(nr(SYSCALLS, "landlock_add_rule"), ruleset, 1, ctypes.create_string_buffer(rule, len(rule)),
                           0), f"landlock_add_rule {path}")
        os.close(beneath)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    check(libc.syscall(nr(SYSCALLS, "landlock_restrict_self"), ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)


# -- privileges ----------------------------------------------------------------------------------------

def drop_privileges(libc, uid: int | None, gid: int | None) -> None:
    """No capability survives the next exec: an empty bounding set, no ambient set, no new privileges,
    and (when asked) another user."""
    for cap in range(CAP_LAST + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails without CAP_SETPCAP, where there is nothing to drop
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
    if uid is not None:
        os.setresuid(uid, uid, uid)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if any(libc.prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1 for cap in range(CAP_LAST + 1)) and os.geteuid() == 0:
        raise OSError("could not empty the capability bounding set")


# -- the unshare level's private mounts ------------------------------------------------------------------

def mount(libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def root_only_files() -> list[tuple[str, bool]]:
    """(path, is_dir) under /etc that others may not read (/etc/shadow, private keys)."""
    hidden = []
    for dirpath, dirnames, filenames in os.walk("/etc"):
        for name in list(dirnames):
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if not stat.S_ISLNK(mode) and not mode & stat.S_IXOTH:
                hidden.append((os.path.join(dirpath, name), True))
                dirnames.remove(name)
        for name in filenames:
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if stat.S_ISREG(mode) and not mode & stat.S_IROTH:
                hidden.append((os.path.join(dirpath, name), False))
    return hidden


def private_mounts(libc, workdir: str, tmp_bytes: int, stays_root: bool) -> None:
    """Inside new mount and PID namespaces (as their root): the host's tree read-only, a fresh /dev,
    size-capped tmpfs for the temporary directories, and the working directory bound back read-write;
    for a command that keeps uid 0, root-only files in /etc covered."""
    keep = {name: os.open(f"/dev/{name}", os.O_PATH) for name in DEVICES if os.path.exists(f"/dev/{name}")}
    work = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
    attr = struct.pack("=QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0)  # struct mount_attr: set, clear, propagation, userns
    check(libc.syscall(nr(SYSCALLS, "mount_setattr"), AT_FDCWD, b"/", AT_RECURSIVE,
                       ctypes.create_string_buffer(attr, len(attr)), len(attr)), "mount_setattr /")
    mount(libc, "tmpfs", "/dev", "tmpfs", MS_NOSUID, "size=1m,mode=755")
    for name, fd in keep.items():
        open(f"/dev/{name}", "w").close()
        mount(libc, f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    for path, is_dir in root_only_files() if stays_root else []:
        if is_dir:
            mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,mode=700")
        else:
            mount(libc, "/dev/null", path, None, MS_BIND)
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=1777")
    mount(libc, None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, "size=1m,mode=755")  # nothing new in /dev
    os.makedirs(workdir, exist_ok=True)  # when it lay under /tmp, the fresh tmpfs needs the mount point again
    mount(libc, f"/proc/self/fd/{work}", workdir, None, MS_BIND | MS_REC)
    mount(libc, None, workdir, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)  # read-write again
    os.close(work)
    os.chdir(workdir)  # the old working directory is the read-only one underneath


# -- running the command ---------------------------------------------------------------------------------

def resolve(program: str) -> str:
    """``program``'s path, found before the privilege drop (after it, a Python installed in a home
    directory cannot import what ``os.execvp`` would)."""
    if "/" in program:
        return program
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(":"):
        if os.access(os.path.join(d, program), os.X_OK):
            return os.path.join(d, program)
    return program


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


def supervise(libc, level: str, workdir: str, uid: int | None, gid: int | None, command: list[str]) -> int:
    """Run ``command`` confined in a child; kill everything it left when it ends or we are told to stop."""
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def on_term(signum, frame):
        raise Stop

    signal.signal(signal.SIGTERM, on_term)
    stays_root = (uid is None and os.geteuid() == 0) or uid == 0
    # Landlock has no right for metadata: a command that may own files outside (anyone but nobody or an
    # episode's own user) gets no chmod/chown/utimes/xattr at all; on the process level, only one that stays root.
    owns_nothing = uid == NOBODY_UID or uid in EPISODE_UIDS
    no_metadata = level == "landlock" and not owns_nothing or level == "process" and stays_root
    command = [resolve(command[0]), *command[1:]]
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            if level == "landlock":
                landlock(libc, workdir)
            drop_privileges(libc, uid, gid)
            install_seccomp(libc, seccomp_program(level == "landlock", no_metadata))
            os.execv(command[0], command)
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


def main(argv: list[str]) -> int:
    split = argv.index("--")
    (level, workdir, uid_s, gid_s, tmp_s, *cgroups), command = argv[:split], argv[split + 1:]
    uid = None if uid_s == "-" else int(uid_s)
    gid = None if gid_s == "-" else int(gid_s)
    libc = libc_handle()
    try:
        for procs in cgroups:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        if level == "bwrap":
            program = seccomp_program(False, False)
            fd = os.memfd_create("seccomp", 0)
            os.write(fd, program)
            os.lseek(fd, 0, os.SEEK_SET)
            os.set_inheritable(fd, True)
            command = [command[0], "--seccomp", str(fd), *command[1:]]
            if uid is not None:  # else bubblewrap needs root's capabilities; it drops them all (--cap-drop ALL)
                drop_privileges(libc, uid, gid)
            os.execv(command[0], command)
        if level == "unshare":
            os.execvp(command[0], command)
        if level == "unshare-inside":
            private_mounts(libc, workdir, int(tmp_s), uid is None)
    except OSError as exc:
        os.write(2, f"sandbox: could not confine the command: {exc}\n".encode())
        return 126
    return supervise(libc, level, workdir, uid, gid, command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
