"""What one eviction did to one layer (S3 effective ratio, S6 retained mass, Kish ESS)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerReport:
    """One layer's cache after its latest eviction (``probkv.hf.eviction.apply_selection``),
    replaced by every eviction: the prompt's (stage 1) and, with a decode budget, each decode
    stage (S10.5), so it describes the evicted prefix the layer holds now. Tokens added since
    the latest eviction sit in the dense tail, all kept (fewer than ``every`` with a decode
    budget) and are not counted here.

    ``prefix_length`` (``t``): the tokens the layer had seen at that eviction (the prompt's
    length at stage 1; prompt plus generated tokens at a decode stage). ``kept_per_head``:
    the entries each KV head keeps of them, ``nbytes`` their bytes (keys, values,
    log-weights). ``effective_ratio``: ``1 - kept / t`` averaged over heads, the share of
    every token seen so far that is no longer held (after decode stages it grows with the
    generation: ``B`` kept of ``t``). ``target_ratio``: the policy's ``ratio`` at stage 1
    (with a decode budget ``1 - B / t``), ``1 - B / t`` at a decode stage.
    ``retained_attention_mass``: the latest query's attention mass on the kept entries, over
    the entries held before the eviction. ``effective_sample_size``: Kish's ESS of the kept
    entries' weights as they are now (composed over the stages; ``None`` without weights).
    """

    layer_idx: int
    prefix_length: int  # t: logical entries (tokens seen) at the latest eviction
    kept_per_head: list[int]
    target_ratio: float
    effective_ratio_per_head: list[float]
    retained_attention_mass: list[float]  # latest query's attention mass on the kept entries
    effective_sample_size: list[float] | None  # Kish ESS of the weights; None without weights
    stage: int = 1  # 1: the prompt's eviction; 2, 3, ...: a decode budget's stages
    nbytes: int = 0  # bytes of the kept entries (keys, values, log-weights)

    @property
    def effective_ratio(self) -> float:
        kept = sum(self.kept_per_head)
        return 1.0 - kept / (self.prefix_length * len(self.kept_per_head))

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["effective_ratio"] = self.effective_ratio
        return out
