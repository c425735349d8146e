"""The seam to NVML: the only package that imports pynvml.

`errors` classifies NVML return codes once; `library` loads the real driver library or installs the
simulator's fake beneath pynvml; `device` wraps one GPU's handle so every read goes through the error policy.
"""
