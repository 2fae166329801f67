"""What one eviction did to one layer (S3 effective ratio, S6 retained mass, Kish ESS)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerReport:
    """What eviction did to one layer (S3 effective ratio, S6 retained mass, Kish ESS)."""

    layer_idx: int
    prefix_length: int  # t: logical entries that existed at eviction time
    kept_per_head: list[int]
    target_ratio: float
    effective_ratio_per_head: list[float]
    retained_attention_mass: list[float]  # last query's attention mass on the kept entries
    effective_sample_size: list[float] | None  # Kish ESS of the weights; None without weights

    @property
    def effective_ratio(self) -> float:
        kept = sum(self.kept_per_head)
        return 1.0 - kept / (self.prefix_length * len(self.kept_per_head))

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["effective_ratio"] = self.effective_ratio
        return out
