"""Loading classifier directories, tokenisation with offsets, head-on-top adapters, the encoder
view, and the LRP head mask with its calibration."""
