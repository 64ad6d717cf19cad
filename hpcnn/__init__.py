"""hpcnn: MPI-native parallel training of neural networks on MPI and NumPy (CuPy on GPUs)."""

__version__ = "0.1.0"
