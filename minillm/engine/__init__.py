"""Engines: the single-sequence reference path and the continuous-batching LLMEngine."""
