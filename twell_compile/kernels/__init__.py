"""Kernel implementations: device code only. Chosen by twell_compile.dispatch."""
