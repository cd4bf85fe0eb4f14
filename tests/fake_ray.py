"""Ray as the driver's loops use it (wait, get, kill), for tests of those loops without a
cluster: each call's ObjectRef is a Call, answered (or failed) when the test says so."""

from __future__ import annotations


class ActorDied(Exception):
    """What Ray raises for a call to an actor whose worker died (its RayActorError)."""


class Call:
    """An ObjectRef: its value or error, once `ready`."""

    def __init__(self, value=None, error: BaseException | None = None, ready: bool = False):
        self.value, self.error, self.ready = value, error, ready


class FakeRay:
    class exceptions:
        RayActorError = ActorDied

    def wait(self, refs, num_returns=1, timeout=None, fetch_local=True):
        ready = [ref for ref in refs if ref.ready][:num_returns]
        return ready, [ref for ref in refs if ref not in ready]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, *args, **kwargs):
        pass


class QuietWatch:
    """Every agent answers; nothing is silent, stalled or judged."""

    def __init__(self):
        self.stalled: dict = {}

    def look(self):
        return []

    def next_look(self):
        return 0.01

    def silent_for(self, seconds):
        return set()

    def same_look(self, nodes):
        return None

    def answers(self, node):
        return []

    def pending(self):
        return []

    def forget(self, node):
        pass
