"""The private CUDA toolkit from NVIDIA's redistributable archives: the manifest and plan, the resumable
download, the checked unpack into a tree with its receipt. `app/prepare_v100_cuda.py` runs them in order.
"""
