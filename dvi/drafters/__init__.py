"""The drafter kinds, each behind one `Proposer` (`proposers`): learned drafters (`learned`:
`separate`, `early_exit`; `eagle`), reduced draft vocabularies (`vocab`) and the model-free
suffix drafter (`suffix_index`, `suffix`, `suffix_proposer`: `suffix` and `hybrid`).

Callers import from the module that defines a name.
"""
