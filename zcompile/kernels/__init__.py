"""Triton kernels exposed as torch.library custom ops (with fake implementations and pure-torch CPU fallbacks).

Stages 0-3 need none: their communication is plain functional collectives and inductor generates the compute.
The ZeRO++ quantization kernels (qwZ/qgZ) land here.
"""
