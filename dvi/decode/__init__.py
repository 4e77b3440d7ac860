"""Decoding: the speculative engine (`engine`) and the parts of one step it calls, one module per job:
the per-row state (`seq`, `request`), choosing K (`adaptive`, `acceptance`, `calibration_rows`), the
ragged KV cache (`kv`), width-invariant attention (`numerics`), the acceptance rules (`sampling`),
what a step emits (`emit`) and the one record of a decoded sequence (`results`).

It imports the drafter kinds (`dvi.drafters`) through their `Proposer` interface; nothing here
starts a server or a process. Callers import from the module that defines a name.
"""
