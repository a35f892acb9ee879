"""VASE: life-long disentangled representation learning (Achille et al., NeurIPS 2018)."""

__version__ = "0.1.0"
