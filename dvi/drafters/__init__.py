"""The drafter kinds, each behind one `Proposer` (`proposer`, made by `factory.make_proposer`): learned drafters
(`learned`: `separate`, `early_exit`; `eagle`) with their proposers (`model_proposer`, `eagle_proposer`) and
caches (`draft_cache`), reduced draft vocabularies (`vocab`), and the model-free history drafter (`suffix_index`,
`suffix`; proposers `suffix_proposer`, `hybrid_proposer`).

Callers import from the module that defines a name.
"""
