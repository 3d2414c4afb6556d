"""Masked-diffusion LLM serving (dLLM-Serve): LLaDA generation, Refresh/Reuse phases.

`reference` is the plain, cache-free definition of what a generation produces; a cached
engine must reproduce it token for token.
"""
