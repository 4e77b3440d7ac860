"""The speculative engine (`speculative`) and its calibration forwards (`calibration`): the one layer that joins
the decoding primitives (`dvi.decode`) with the drafter kinds (`dvi.drafters`) and the target's checks
(`dvi.models`), so that none of those imports anything back up. Callers import from the module that defines a
name."""
