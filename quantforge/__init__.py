"""quantforge: quantize a causal LM into every deployable format, measure each, recommend one."""

__version__ = "0.1.0"
# The distribution's name on PyPI ("quantforge" there is another project); the import package and the command stay
# quantforge.
DISTRIBUTION = "quantforge-llm"


def install_hint(extra: str) -> str:
    """The pip command that installs an extra of this distribution."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
