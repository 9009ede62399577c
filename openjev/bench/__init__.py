"""The bench's library half: agreement and the group audit, the /classify client, the run's inputs, the receipt.

`app/bench_classify_v100.py` reads as its phases over these; the tuner and the benchmarks reuse them.
"""
