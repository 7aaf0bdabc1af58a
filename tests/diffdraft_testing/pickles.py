"""A pickle that runs code when loaded: what a hostile checkpoint from elsewhere could hold."""

from __future__ import annotations


class RunsCode:
    """Pickled, it creates ``marker`` when unpickled: what a hostile state file could do instead."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))
