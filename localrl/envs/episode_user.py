"""Each episode's commands as a user of their own: episodes of one step, which run side by side, cannot touch each
other's working directories.

Run as root, the shell environment used to hand every episode to ``nobody``: one user for all of them, so a
command could ``chmod 000`` a sibling episode's directory (metadata calls need no Landlock right) and make it score
0 (a reward hack), or delete what the sibling wrote. Now each episode gets a uid of its own from a range no
account uses (``confine.EPISODE_UIDS``: 4096 uids from 0x7F000000), its directory (mode 0700) is handed to it, and
no other episode's user may enter, list, change or remove it.

A uid is claimed by binding an abstract Unix socket named after it, which the kernel lets go when the holder
closes it or dies: no file to leave behind or to be planted by someone else. The claim is per network namespace,
so two localrl processes in different network namespaces sharing one /tmp could draw the same uid (their
directories are still 0700 and named apart).
"""

from __future__ import annotations

import random
import socket

from localrl.envs.confine import EPISODE_UIDS


class EpisodeUser:
    """A uid that no other live episode on this machine holds, for as long as this object lives (its socket)."""

    def __init__(self) -> None:
        start = random.randrange(len(EPISODE_UIDS))  # (a busy machine's claims are not all scanned each time)
        for i in range(len(EPISODE_UIDS)):
            uid = EPISODE_UIDS[(start + i) % len(EPISODE_UIDS)]
            claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                claim.bind(f"\0localrl-episode-uid-{uid}")
            except OSError:
                claim.close()
                continue
            self.uid, self._claim = uid, claim
            return
        raise RuntimeError(f"all {len(EPISODE_UIDS)} episode users are in use")

    @property
    def ids(self) -> tuple[int, int]:
        return self.uid, self.uid  # its own group too
