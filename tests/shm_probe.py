"""What a process holds of /dev/shm, read from /proc: the leak check for unnamed segments."""
import os


def held_shm(pid: int) -> set[str]:
    """``/dev/shm`` files (named or unnamed) that ``pid`` has open or mapped; empty if it is gone."""
    out: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                out.add(target)
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    out.add(parts[5].rstrip("\n"))
    except (FileNotFoundError, ProcessLookupError):
        return set()
    return out


def shm_used_bytes(path: str = "/dev/shm") -> int:
    """Bytes in use on the tmpfs at ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
