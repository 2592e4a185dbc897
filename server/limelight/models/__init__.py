"""Loading classifier directories, tokenisation with offsets, head-on-top adapters."""
