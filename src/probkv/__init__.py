"""probkv: KV-cache eviction as importance sampling, with decode-time correction.

See ../shared/SPEC.md (sections S1-S9) and docs/architecture.md.
"""

__version__ = "0.1.0"
