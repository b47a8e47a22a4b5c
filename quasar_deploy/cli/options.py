"""Option types more than one command shares, so that the same kind of value parses, and fails, the same way everywhere."""

from __future__ import annotations

import click


class IntList(click.ParamType):
    """``"1,2,3"`` -> ``(1, 2, 3)``; anything else is click's usual "Invalid value for '--option'" usage error."""

    name = "INTS"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return tuple(int(v) for v in str(value).split(",") if v.strip())
        except ValueError:
            self.fail(f"expected comma-separated integers, not {value!r}", param, ctx)


INT_LIST = IntList()
