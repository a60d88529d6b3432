"""C++/CUDA sources, built lazily with ninja through torch.utils.cpp_extension (not Python)."""
