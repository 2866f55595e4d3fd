"""trainguard: a reliability and operations control plane for GPU training clusters.

The distribution ships several top-level packages (``controller``, ``agents``,
``collectives``, ``checkpoint``, ``power``, ``web``); this package holds only what
they share: the wire contract (:mod:`trainguard.wire`), the local-socket framing
(:mod:`trainguard.framing`) and the CLI (:mod:`trainguard.cli`).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
