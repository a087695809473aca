"""Model configs, K3 and DSpark modules, weight loading (safetensors, TP slices, MXFP4)."""
