"""megabase.kernels: one folder per op, a pure-PyTorch reference beside each fast kernel (DESIGN.md, Model)."""
