"""CPU kernels compiled on first use (C++ through torch.utils.cpp_extension): see kquant.py."""
