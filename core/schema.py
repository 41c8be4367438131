"""The base of every typed config: unknown keys are errors, assignments are validated.

The recipe schema (`draftsmith.recipe`) and each kind's own config section build on these.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section: unknown keys are rejected, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KindConfig(StrictModel):
    """The recipe's ``drafter:`` section of one drafter kind.

    A kind's subclass sets ``kind: Literal["NAME"]`` (the discriminator of the recipe's union of kinds)
    and its own fields, each with its help text.
    """

    kind: str
