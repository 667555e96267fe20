"""What every section of the YAML contract shares: the section base class and the cross-field rule error."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RuleError(ValueError):
    """A broken cross-field rule. `field` is the key it is reported at and `involves` the other keys it reads
    (dotted, relative to the model): the loader points at that key's line and stays quiet about a rule fed by
    a value that is already reported as wrong."""

    def __init__(self, message: str, field: str | None = None, involves: tuple[str, ...] = ()):
        super().__init__(message)
        self.field, self.involves = field, involves


class Section(BaseModel):
    # inf and nan are never meant: they would slip past gt=0 and break arithmetic downstream
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
