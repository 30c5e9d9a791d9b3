"""rkgb: the Rockmate graph builder (capture, simplify, blocks, inspect, CD-graphs).

Importing this package does not import torch: :mod:`rkgb.cdgraph` is torch-free so that the
solvers can be used and tested without torch. Import the torch phases from their modules.
"""
