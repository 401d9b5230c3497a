"""specplan: adaptive speculative decoding, planned from the roofline and measured step times."""

__version__ = "0.1.0"
