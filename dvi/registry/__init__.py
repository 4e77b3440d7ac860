"""The versioned drafter registry the trainer publishes to and the server loads from (`store`:
`DrafterRegistry`), and its parts below it (`base`: refusals, the tensor-spec check, the server's
durable records).

Callers import from the module that defines a name.
"""
