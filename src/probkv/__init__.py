"""probkv: KV-cache eviction as importance sampling, with decode-time correction.

See docs/maths.md (the mathematics, sections S1-S10) and docs/architecture.md.
"""

__version__ = "0.1.0"
