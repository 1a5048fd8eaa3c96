"""Bridges: lower interp_engine Plans onto an engine. The only package that imports vllm
(in ``bridge.vllm``, imported lazily)."""
