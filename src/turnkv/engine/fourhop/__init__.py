"""The four-hop engine family: a render service, ``--tokens-only`` prefill and decode engines, and derender."""

from turnkv.engine.fourhop.engine import FourHopEngine, fourhop_engine

__all__ = ["FourHopEngine", "fourhop_engine"]
