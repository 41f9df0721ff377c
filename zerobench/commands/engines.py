"""List the engines, each with its matrix axes: default, allowed values and meaning."""

from __future__ import annotations

HELP = "list the engines and their matrix axes"


def arguments(p) -> None:
    pass


def main(args) -> int:
    from zerobench.engines import ENGINES, get_engine
    from zerobench.spec.axes import engine_axes

    for name in ENGINES:
        why = get_engine(name).unavailable()
        print(f"{name}   (unavailable: {why})" if why else name)
        for axis, spec in engine_axes(name).items():
            doc = f"  ({spec.doc})" if spec.doc else ""
            print(f"    {axis} = {spec.default!r}   allowed: {spec.allowed()}{doc}")
    return 0
