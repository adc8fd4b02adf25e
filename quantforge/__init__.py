"""quantforge: quantize a causal LM into every deployable format, measure each, recommend one."""

__version__ = "0.1.0"
