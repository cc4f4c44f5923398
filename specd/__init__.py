"""specd: speculative decoding whose drafter keeps learning from the traffic it serves."""

__version__ = "0.1.0"
