"""Drafters behind one interface (`dspark.draft.base.Drafter`) and the name → drafter resolution.

* `DSparkDrafter` — the DSpark stages `mtp.0..2` of a DSpark checkpoint or a trained drafter
  directory (`load_drafter`), or a fresh one (`DSparkDrafter(target).init_weights(seed)`);
* `MtpDrafter` — the target's own MTP block (`mtp.0`), the MTP-1 baseline;
* `NgramDrafter` — prompt lookup, no weights.
"""

from __future__ import annotations

from dspark.draft.base import DraftProposal, Drafter
from dspark.draft.config import DSparkConfig
from dspark.draft.drafter import DSparkDrafter
from dspark.draft.io import load_drafter, save_drafter
from dspark.draft.mtp import MtpDrafter
from dspark.draft.ngram import NgramDrafter

DRAFTER_NAMES = ("dspark", "mtp", "ngram")


def _has_mtp(model) -> bool:
    """The model's MTP block holds trained weights (a checkpoint without `mtp.*` leaves it random)."""
    return bool(getattr(model, "has_mtp", False)) and len(getattr(model, "mtp", ())) > 0


def resolve_drafter(model, drafter):
    """The drafter `generate` uses: an object passes through; a name is built for `model`.

    None picks the best the model offers: its DSpark drafter (`model.dspark`), else its MTP block,
    else n-gram lookup.
    """
    if drafter is None:
        drafter = "dspark" if getattr(model, "dspark", None) is not None else "mtp" if _has_mtp(model) else "ngram"
    if not isinstance(drafter, str):
        for attr in ("block_size", "capture_layers", "new_state", "observe", "propose"):
            if not hasattr(drafter, attr):
                raise ValueError(f"drafter {type(drafter).__name__} lacks {attr!r} (see dspark.draft.base.Drafter)")
        return drafter
    if drafter == "dspark" and getattr(model, "dspark", None) is not None:
        return model.dspark
    if drafter == "mtp" and _has_mtp(model):
        return MtpDrafter(model)
    if drafter == "ngram":
        return NgramDrafter()
    raise ValueError(f"drafter {drafter!r} is not available for this model; choose from {DRAFTER_NAMES} "
                     f"that the model supports")


__all__ = ["DRAFTER_NAMES", "DSparkConfig", "DSparkDrafter", "DraftProposal", "Drafter", "MtpDrafter",
           "NgramDrafter", "load_drafter", "resolve_drafter", "save_drafter"]
