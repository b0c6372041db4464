"""Who may use `farm cache-serve`: a tokens file of Redis ACL-style users, one a line,

    NAME ROLE TOKEN        # ROLE: read (GET) or write (GET and SET)

which clients name in their URL as redis-py does: `redis://NAME:TOKEN@host:port`.

A writer's entries are unpickled by every reader: whoever holds a `write` token can run code in
every training job that reads the cache. Hand write tokens only to CI or the farm's workers
(README, "PyTorch's own remote caches"). The file holds secrets, so one that others may read is
refused, as ssh refuses a key file.
"""
from __future__ import annotations

import hmac
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

ROLES = ("read", "write")
MIN_TOKEN = 16
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class TokensError(ValueError):
    """The tokens file cannot be used: which file, which line, and what to do."""


@dataclass(frozen=True)
class User:
    name: str
    role: str
    token: str = ""

    @property
    def writes(self) -> bool:
        return self.role == "write"


class Users:
    def __init__(self, users: list[User]):
        self._by_name = {u.name: u for u in users}

    def __len__(self) -> int:
        return len(self._by_name)

    def as_tuples(self) -> tuple[tuple[str, str, str], ...]:
        """(name, role, token) each: to hand them to a farm service's actor."""
        return tuple((u.name, u.role, u.token) for u in self._by_name.values())

    def check(self, name: str, token: str) -> User | None:
        """The user, if the token is theirs (compared in constant time), else None."""
        user = self._by_name.get(name)
        expected = user.token if user is not None else "x" * MIN_TOKEN  # the same work for an unknown name
        ok = hmac.compare_digest(expected.encode(), token.encode())
        return user if user is not None and ok else None


def read_tokens(path: str | Path) -> Users:
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as e:
        raise TokensError(f"tokens file {path}: cannot be read ({e.strerror or e}); give --tokens a file of "
                          f"'NAME ROLE TOKEN' lines") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and os.name == "posix":
        raise TokensError(f"tokens file {path}: others may read it (mode {stat.filemode(mode)}), and it holds "
                          f"secrets; chmod 600 {path}")
    users: list[User] = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"tokens file {path}, line {n}"
        if len(words) != 3:
            raise TokensError(f"{where}: expected 'NAME ROLE TOKEN', found {len(words)} words")
        name, role, token = words
        if not _NAME.fullmatch(name):
            raise TokensError(f"{where}: the name {name[:70]!r} is not 1-64 letters, digits or '_.@-'")
        if role not in ROLES:
            raise TokensError(f"{where}: the role {role[:20]!r} is not one of {', '.join(ROLES)}")
        if len(token) < MIN_TOKEN:
            raise TokensError(f"{where}: {name}'s token is shorter than {MIN_TOKEN} characters; make one with {MAKE_ONE}")
        if any(u.name == name for u in users):
            raise TokensError(f"{where}: {name} is named twice")
        users.append(User(name, role, token))
    if not users:
        raise TokensError(f"tokens file {path}: no users in it; add 'NAME ROLE TOKEN' lines (make a token with {MAKE_ONE})")
    return Users(users)
