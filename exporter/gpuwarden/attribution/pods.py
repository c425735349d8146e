"""The pods stage of the pipeline: which containers hold each GPU, joined from the kubelet's last answer."""

from __future__ import annotations

from gpuwarden.attribution import podresources
from gpuwarden.model.draft import Draft


class PodsStep:
    """Which containers hold each GPU, from the kubelet's last answer (never fetched here; None: attribution off)."""

    def __init__(self, attribution: podresources.PodAttribution | None) -> None:
        self.attribution = attribution

    def __call__(self, draft: Draft) -> None:
        view = self.attribution.view if self.attribution is not None else podresources.DISABLED
        draft.pods_state = view.state
        gpus = [(g.index, g.uuid, g.info.mig_uuids or ()) for g in draft.gpus if g.up]
        aliases = podresources.dra_aliases(
            (g.uuid, g.info.minor_number, g.info.mig_placements or ()) for g in draft.gpus if g.up
        )
        draft.pods, draft.pods_unmatched = podresources.assign(view, gpus, aliases)
        draft.mig_pods = podresources.assign_mig(view, gpus, aliases)
