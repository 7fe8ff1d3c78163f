"""The CPU backend: native kernels (C, built at run time by `build.py`, called through
`native.py`) and the CPU attention backend over the paged cache (`attention.py`)."""
