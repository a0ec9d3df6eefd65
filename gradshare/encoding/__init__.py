"""Threshold encoding (Strom 2015): fused accumulate+encode kernels, message forms, thresholds."""
