"""List the engines, each with its matrix axes: default, allowed values and meaning.

The axes every engine has (activation checkpointing, the emulated link) are listed once,
first; then each engine with the axes of its own. Lines fit the terminal (``COLUMNS``
when set), and the listing stops quietly when its reader does (``zerobench engines | head``)."""

from __future__ import annotations

HELP = "list the engines and their matrix axes"


def arguments(p) -> None:
    pass


def main(args) -> int:
    from zerobench.analysis.render import console_width
    from zerobench.engines import ENGINES, get_engine
    from zerobench.spec.axes import engine_axes

    width = console_width()
    names = list(ENGINES)
    axes = {name: engine_axes(name) for name in names}
    shared = [axis for axis, spec in axes[names[0]].items()
              if all(repr(spec) == repr(axes[name].get(axis)) for name in names)]
    lines = ["every engine"] + [line for axis in shared for line in _axis_lines(axis, axes[names[0]][axis], width)]
    for name in names:
        why = get_engine(name).unavailable()
        lines.append(f"{name}   (unavailable: {why})" if why else name)
        own = [axis for axis in axes[name] if axis not in shared]
        lines += [line for axis in own for line in _axis_lines(axis, axes[name][axis], width)]
        if not own:
            lines.append("    (only the axes every engine has)")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # the reader stopped reading (| head): not an error of ours
        import os
        import sys

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _axis_lines(axis: str, spec, width: int) -> list[str]:
    """``    axis = default   allowed: ...`` and its meaning, wrapped at ``width``."""
    import textwrap

    head = f"{axis} = {spec.default!r}   allowed: {spec.allowed()}"
    lines = textwrap.wrap(head, width, initial_indent="    ", subsequent_indent="        ")
    if spec.doc:
        lines += textwrap.wrap(spec.doc, width, initial_indent="        ", subsequent_indent="        ")
    return lines
