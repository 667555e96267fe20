"""llmdeploy: declarative deployment of LLM inference (own engine, routing proxy, gray release)."""

__version__ = "0.1.0"
