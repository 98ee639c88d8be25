"""How an adapter's calibration was fitted, as one typed record.

An adapter's ``method`` section (written by ``calm fit``) and its ``abstention`` section
(``calm fit threshold``) say which mode and cloze variant its temperatures belong to. Every
command reads them through :class:`FitRecord` (``CalibrationAdapter.fit_record``), never
from the dicts, and a request that disagrees with the record is decided by
:func:`calm_runtime.data.prompts.cloze_variant_for`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS, MODE_NAMES

__all__ = ["FitRecord", "FIT_MODES"]

#: the modes a fit records: multiple choice (cloze, letter) and open-QA P(True)
FIT_MODES = MODE_NAMES


@dataclass(frozen=True)
class FitRecord:
    #: the fit's mode (``cloze``, ``letter`` or ``p_true``); ``None`` when not recorded
    #: (an identity adapter, a CALM adapter)
    mode: str | None = None
    #: the cloze variant the answer temperature was fitted on (cloze fits)
    cloze_variant: str | None = None
    #: the cloze answer temperature (``None``: none fitted)
    answer_temperature: float | None = None
    #: ``cloze`` or ``letter``: the abstention threshold's mode, else the fit's
    choice_mode: str | None = None

    @classmethod
    def parse(cls, method: Mapping | None, abstention: Mapping | None,
              answer_temperature: float | None) -> FitRecord:
        """The record of an adapter's sections; unknown values read as not recorded (the
        adapter's own validation refuses malformed sections when it is loaded)."""
        method = method if isinstance(method, Mapping) else {}
        mode = method.get("mode") if method.get("mode") in FIT_MODES else None
        variant = method.get("variant") if method.get("variant") in CLOZE_VARIANTS else None
        choice = None
        for section in (abstention, method):
            if isinstance(section, Mapping) and section.get("mode") in CHOICE_MODES:
                choice = section["mode"]
                break
        return cls(mode=mode, cloze_variant=variant, answer_temperature=answer_temperature,
                   choice_mode=choice)

    @property
    def binds_variant(self) -> bool:
        """Whether an answer temperature hangs on the recorded cloze variant."""
        return self.cloze_variant is not None and self.answer_temperature is not None
