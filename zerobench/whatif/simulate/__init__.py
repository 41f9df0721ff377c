"""``zerobench simulate``: predict a schedule's step time, exposed communication and
unsharded memory on another link, world size or device speed (docs/simulate.md).

Pure Python: :mod:`.schedule` and :mod:`.model` import without torch (and without
numpy or pandas); :mod:`.extract` reads traces (pandas), :mod:`.plots` draws (matplotlib).
"""

from .model import SimResult, Span, simulate
from .schedule import Knobs, Schedule, Unit

__all__ = ["Knobs", "Schedule", "SimResult", "Span", "Unit", "simulate"]
