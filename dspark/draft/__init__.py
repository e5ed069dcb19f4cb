"""Drafters behind one interface (`dspark.draft.base.Drafter`) and the name → drafter resolution."""

from __future__ import annotations

from dspark.draft.base import DraftProposal, Drafter
from dspark.draft.ngram import NgramDrafter

DRAFTER_NAMES = ("dspark", "mtp", "ngram")


def resolve_drafter(model, drafter):
    """The drafter `generate` uses: an object passes through; a name is built for `model`.

    None picks the best the model offers: its DSpark stages, else its MTP block, else n-gram lookup.
    """
    if drafter is None:
        drafter = "ngram"
    if not isinstance(drafter, str):
        for attr in ("block_size", "capture_layers", "new_state", "observe", "propose"):
            if not hasattr(drafter, attr):
                raise ValueError(f"drafter {type(drafter).__name__} lacks {attr!r} (see dspark.draft.base.Drafter)")
        return drafter
    if drafter == "ngram":
        return NgramDrafter()
    raise ValueError(f"drafter {drafter!r} is not available for this model; choose from {DRAFTER_NAMES} "
                     f"that the model supports")


__all__ = ["DRAFTER_NAMES", "DraftProposal", "Drafter", "NgramDrafter", "resolve_drafter"]
