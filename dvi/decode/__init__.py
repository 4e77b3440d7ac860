"""Decoding primitives: the parts of one speculative step, one module per job: the per-row state (`seq`,
`request`), choosing K (`adaptive`, `acceptance`, `pricing`), the ragged KV cache (`kv`), width-invariant
attention (`numerics`), the acceptance rules (`sampling`), what a step emits (`emit`) and the one record of a
decoded sequence (`results`).

It imports nothing above it: the engine that runs a step over drafters and a target lives in `dvi.engine`.
Callers import from the module that defines a name.
"""
