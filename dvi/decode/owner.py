"""A debug check that one thread owns the engine: `claim(engine)` on the engine thread, and any other thread that
then reads a public attribute or calls a public method of the engine, its proposer (and a hybrid's parts) or its
suffix cache gets an `OwnershipError` (and the touch is recorded in `VIOLATIONS`).

Off unless `$DVI_ENGINE_OWNER_CHECK` is "1" (the tests set it): `claim` is then a no-op and nothing costs a cycle.
On, `claim` moves each owned object to a subclass of its class whose `__getattribute__` compares the calling
thread with the owner (names starting with "_" are not checked: the owner's own code reads those). What an
object owns is its class's `_owned_parts` (attribute names), claimed with it: the engine owns its `proposer`, a
suffix proposer its `cache`, a hybrid its `learned` and `suffix` parts. A hot swap may bring a new proposer:
the owner claims again after it (`serving.scheduler` does after every between-step command).
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["ENV", "OwnershipError", "VIOLATIONS", "checking", "claim", "release"]

ENV = "DVI_ENGINE_OWNER_CHECK"
VIOLATIONS: list[str] = []  # "thread: Class.attr" of every foreign touch seen (bounded)
_MAX_VIOLATIONS = 1000
_OWNER = "_dvi_owner"
_guarded: dict[type, type] = {}
_lock = threading.Lock()


class OwnershipError(RuntimeError):
    """A thread other than the engine's owner touched the engine, its proposer or its suffix cache."""


def checking() -> bool:
    return os.environ.get(ENV, "") == "1"


def _violation(obj: Any, name: str, owner: int) -> None:
    me = threading.current_thread()
    what = f"{me.name} (ident {me.ident}, owner {owner}): {type(obj).__mro__[1].__name__}.{name}"
    if len(VIOLATIONS) < _MAX_VIOLATIONS:
        VIOLATIONS.append(what)
    raise OwnershipError(f"the engine is owned by another thread; {what}")


def _guarded_class(cls: type) -> type:
    with _lock:
        g = _guarded.get(cls)
        if g is None:
            base_get = cls.__getattribute__

            def __getattribute__(self, name: str, _get=base_get):  # noqa: N807 - the hook's own name
                if name[:1] != "_":
                    owner = object.__getattribute__(self, _OWNER)
                    if owner is not None and threading.get_ident() != owner:
                        _violation(self, name, owner)
                return _get(self, name)

            g = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                             "__qualname__": cls.__qualname__, "_dvi_guarded": True})
            _guarded[cls] = g
            _guarded[g] = g
        return g


def _walk(obj: Any, owner: int | None, seen: set[int]) -> None:
    if obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    if owner is not None and not getattr(type(obj), "_dvi_guarded", False):
        obj.__class__ = _guarded_class(type(obj))
    if getattr(type(obj), "_dvi_guarded", False):
        object.__setattr__(obj, _OWNER, owner)
    for name in getattr(type(obj), "_owned_parts", ()):
        _walk(obj.__dict__.get(name), owner, seen)


def claim(obj: Any, thread_ident: int | None = None) -> bool:
    """With the check on: `obj` and what it owns (`_owned_parts`) belong to `thread_ident` (default: the calling
    thread) from now on. False (nothing done) with the check off."""
    if not checking():
        return False
    _walk(obj, threading.get_ident() if thread_ident is None else thread_ident, set())
    return True


def release(obj: Any) -> None:
    """No owner any more (any thread may touch it): after the engine thread ended."""
    _walk(obj, None, set())
