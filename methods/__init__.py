"""The methods beyond the core's guessers (drafters.py), one file each beside its paper, and what
builds them.

- `registry.py`: every `--method`, its help, options, size and how to build it; the options and loading
  every program shares.
- `recycling.py` (Token Recycling, Luo et al. 2024), `medusa.py` (Cai et al. 2024), `ppd.py` (parallel
  prompt decoding, Chen et al. 2024), `eagle.py` (EAGLE, Li et al. 2024), `combined.py` (`--method auto`), `apar.py` (auto-parallel decoding,
  Liu et al. 2024; not lossless) and `apar_quality.py` (how good its answers are).
- `cost_aware.py` and `latency.py`: cost-aware drafting, the part of a tree that pays at this machine's
  L(n), and L(n) itself.
- `artifacts.py`: trained parts (safetensors) and the model they were made for.
"""
