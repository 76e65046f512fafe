"""Stand-ins for Ray actor handles in tests that run routers and pools without Ray."""

from __future__ import annotations

import concurrent.futures


class Ref:
    """An already-resolved object ref: awaitable, and ``future()`` like Ray's ObjectRef."""

    def __init__(self, value):
        self.value = value

    def future(self):
        f = concurrent.futures.Future()
        f.set_result(self.value)
        return f

    def __await__(self):
        async def v():
            return self.value
        return v().__await__()


class Handle:
    """Stands in for an actor handle: ``h.method.remote(*a)`` calls ``obj.method(*a)`` now."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        fn = getattr(self._obj, name)

        class _M:
            @staticmethod
            def remote(*a, **k):
                return Ref(fn(*a, **k))
        return _M
