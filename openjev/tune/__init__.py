"""The tuner's library half: profiles and input sets, the comparison, the processes it owns, the run itself.

`app/tune_sglang_v100.py` parses the command line and hands over to `openjev.tune.tuner.Tuner`.
"""
